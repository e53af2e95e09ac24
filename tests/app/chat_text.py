"""A chat row's text as its words read, for tests about a reply's text and stats line: without the links under
each message (‹ 2/3 › to its other branches, ✎ edit, new chat from here), which app/ui.py's message_links adds."""

import re

ACTIONS = re.compile(r"(?: · )?\[(?:✎ edit|new chat from here)\]\(#pagoda-(?:edit|branch)-\d+\)")
NAV = re.compile(r"(?:\[‹\]\(#pagoda-show-\d+\)|‹) \d+/\d+ (?:\[›\]\(#pagoda-show-\d+\)|›)(?: · )?")


def without_links(content: str) -> str:
    return NAV.sub("", ACTIONS.sub("", content)).replace("\n\n<sub></sub>", "")
