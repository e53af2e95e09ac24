"""What serves the engine to the outside: the OpenAI-compatible HTTP API (`openai/`), the headless
server's command line (`cli`), and a terminal chat (`demo`). The engine never imports these."""
