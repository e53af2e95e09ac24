import sys

from app.server import main

sys.exit(main())
