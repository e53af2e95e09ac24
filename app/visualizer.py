"""KV cache visualizer: turns the engine's `kv_blocks()` and `stats()` into one HTML string.

No Gradio here: the UI puts the string in a `gr.HTML` that a `gr.Timer` refreshes, and passes
`visualizer_css()` once to `gr.Blocks(css=...)`.

Every block is one tiny element, `<i class="used own3 fill4" title="...">`, styled by classes only:

  kind    (none) empty           `cached` free, but still holds a prefix hash (reused on a hit)
          `used` in use by one request      `shared` ref count > 1 (the count is drawn in it)
  owner   `own0`..`own11` the owning conversation's colour (`own-none`: a request id no conversation
          claims); `also0`..`also11` (`also-none`) a second owner's colour, striped into shared blocks
  fill    `fill0`..`fill7` a partly written block, in eighths (a full block has no fill class)

Blocks sit in `div.grid` with `size1`..`size4` (smaller squares for bigger caches). Above the grid,
`div.header` holds the `.chip` counters, the usage `.bar` and two `.legend` rows of `.legend-entry`.
A cache can have 10,000+ blocks redrawn twice a second, so block classes are short whole words.

Colours come from a hash of the conversation label, so a chat keeps its colour from poll to poll;
labels that collide in one render are moved to the next free colour, in a fixed order.
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.front.outputs import EngineStats, KVBlock

CSS_PATH = Path(__file__).resolve().parent.parent / "assets" / "visualizer.css"
PALETTE_SIZE = 12
FILL_LEVELS = 8
MAX_LABELS_IN_TITLE = 6
MAX_LEGEND_ENTRIES = 12
MAX_REMOTE_ROWS = 40


@functools.lru_cache(maxsize=1)
def visualizer_css() -> str:
    """The visualizer's stylesheet (assets/visualizer.css), for `gr.Blocks(css=...)`."""
    try:
        return CSS_PATH.read_text(encoding="utf-8")
    except OSError as e:
        raise FileNotFoundError(f"the visualizer stylesheet is missing: {CSS_PATH} ({e.strerror})") from None


# ---- colours -------------------------------------------------------------------------------------
def _digest(label: str) -> int:
    return int.from_bytes(hashlib.blake2b(label.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def colour_index(label: str) -> int:
    """The palette slot a conversation label prefers: stable across polls, processes and machines."""
    return _digest(label) % PALETTE_SIZE


def assign_colours(labels: Iterable[str]) -> dict[str, int]:
    """A palette slot per label: its preferred one, or the next free one when another label present took it.

    Labels are settled in digest order, so the outcome does not depend on the order they are given in.
    With more than PALETTE_SIZE labels, colours repeat.
    """
    taken: set[int] = set()
    out: dict[str, int] = {}
    for label in sorted(set(labels), key=lambda s: (_digest(s), s)):
        slot = _digest(label) % PALETTE_SIZE
        if len(taken) < PALETTE_SIZE:
            while slot in taken:
                slot = (slot + 1) % PALETTE_SIZE
        taken.add(slot)
        out[label] = slot
    return out


# ---- formatting ----------------------------------------------------------------------------------
def format_hit_rate(hits: float | None, queries: float | None) -> str:
    """Prefix cache hit rate in tokens as a percentage; an em dash before the first query."""
    try:
        hits, queries = float(hits or 0), float(queries or 0)
    except (TypeError, ValueError):
        return "—"
    if queries <= 0:
        return "—"
    return f"{100.0 * hits / queries:.1f}%"


def _fmt_num(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:  # NaN
            return "—"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt_num(x) for x in v)
    return str(v)


def _ascii(s: str) -> str:
    """Non-Latin-1 text as character references: one wide character (a CJK title, an emoji) would
    otherwise make Python store the whole multi-megabyte grid string at 2 or 4 bytes per character."""
    return s if s.isascii() else s.encode("latin-1", "xmlcharrefreplace").decode("latin-1")


def _chip(value: str, label: str, tip: str = "", cls: str = "") -> str:
    t = f' title="{escape(tip)}"' if tip else ""
    c = f" {cls}" if cls else ""
    return f'<span class="chip{c}"{t}><b>{value}</b> {label}</span>'


def _grid_size_class(n: int) -> str:
    if n <= 600:
        return "size1"
    if n <= 2500:
        return "size2"
    if n <= 10000:
        return "size3"
    return "size4"


# ---- the grid ------------------------------------------------------------------------------------
def render_kv_cache(
    blocks: list[KVBlock], stats: EngineStats, owners: dict[str, str] | None = None, tokens_per_s: float | None = None
) -> str:
    """HTML for the KV cache panel: counters, a legend, and a grid with one element per block.

    blocks: `LLMEngine.kv_blocks()`; stats: `LLMEngine.stats()`; owners: engine request id ->
    conversation label (user text: escaped here); tokens_per_s: shown when given.
    """
    holders = _Holders.of(blocks, owners or {})
    groups = stats.kv_groups if len(stats.kv_groups) > 1 else None  # each block's title names its group
    body = (
        f'<div class="grid {_grid_size_class(len(blocks))}">{_grid(blocks, stats.block_size, holders, groups)}</div>'
        if blocks
        else '<p class="none">No KV cache yet: load a model to see its blocks.</p>'
    )
    if stats.num_state_slots:
        body += _state_row(stats)
    head = _ascii(
        f'<div class="pgd-kv"><div class="header"><div class="stats">{_chips(stats, tokens_per_s)}</div>'
        f'{_usage_bar(stats)}<div class="legend">{_legend(holders)}</div>'
        f'<div class="legend kinds">{BLOCK_KINDS}</div></div>'
    )
    return f"{head}{body}</div>"


# What each kind of block looks like, under the conversations' colours
BLOCK_KINDS = (
    '<span class="legend-entry"><i class="used own-none fill3"></i>in use (fill = tokens written)</span>'
    '<span class="legend-entry"><i class="shared own-none">2</i>shared (ref count)</span>'
    '<span class="legend-entry"><i class="cached"></i>free, cached</span>'
    '<span class="legend-entry"><i></i>empty</span>'
)


@dataclass
class _Holders:
    """Who holds the blocks: each legend entry (("c", conversation label) or ("r", request id) for a request no
    conversation claims) with its block count, colour class suffix and escaped name, and per distinct owner list
    its colour classes and tooltip line. Owner lists are few, however many blocks there are."""

    blocks: dict[tuple[str, str], int]
    colour: dict[tuple[str, str], str]  # own3/also3, or own-none/also-none for a request no conversation claims
    display: dict[tuple[str, str], str]
    groups: dict[tuple, tuple[str, str, str]]  # owner list -> (single class, shared classes, tooltip line)

    @classmethod
    def of(cls, blocks: list[KVBlock], owners: dict[str, str]) -> _Holders:
        groups: Counter[tuple] = Counter(b.owners for b in blocks if b.owners)
        entry: dict = {}
        for key in groups:
            for rid in key:
                if rid not in entry:
                    label = owners.get(rid)
                    entry[rid] = ("c", str(label)) if label is not None else ("r", str(rid))
        entry_blocks: dict[tuple[str, str], int] = {}
        group_entries: dict[tuple, list] = {}
        for key, count in groups.items():
            ents = group_entries[key] = list(dict.fromkeys(entry[rid] for rid in key))
            for e in ents:
                entry_blocks[e] = entry_blocks.get(e, 0) + count
        slots = assign_colours(name for kind, name in entry_blocks if kind == "c")
        colour = {e: (str(slots[e[1]]) if e[0] == "c" else "-none") for e in entry_blocks}
        display = {e: _ascii(escape(e[1]) if e[0] == "c" else f"request {escape(e[1])}") for e in entry_blocks}
        group_info: dict[tuple, tuple[str, str, str]] = {}
        for key, ents in group_entries.items():
            first = colour[ents[0]]
            second = next((colour[e] for e in ents[1:] if colour[e] != first), None)
            names = [display[e] for e in ents[:MAX_LABELS_IN_TITLE]]
            if len(ents) > MAX_LABELS_IN_TITLE:
                names.append(f"+{len(ents) - MAX_LABELS_IN_TITLE} more")
            label_word = "owner" if len(ents) == 1 else "owners"
            group_info[key] = (
                f" own{first}",
                f" own{first} also{second}" if second else f" own{first}",
                f"&#10;{label_word}: {', '.join(names)}",
            )
        return cls(entry_blocks, colour, display, group_info)


_NO_OWNER = (" own-none", " own-none", "&#10;owner: none running")


def _grid(blocks: list[KVBlock], bs: int, holders: _Holders, groups: tuple[str, ...] | None = None) -> str:
    """One element per block. This runs a few times a second over every block, so the loop only looks up a
    (prefix, suffix) pair per block kind and puts the block id between them. Kinds are few: (ref count, cached,
    filled, owner list, group) takes a handful of values however many blocks there are. `groups`: the model's
    KV-cache groups, named in each used or cached block's title, where it has several."""

    def template(rc, cached, filled, ow, group) -> tuple[str, str]:
        m = f"{filled}/{bs} tokens · {'cached' if cached else 'not cached'}"
        if groups is not None and (rc > 0 or cached):
            m += f" · KV-cache group {group + 1} ({groups[group]})"
        if rc <= 0:
            if cached:
                return '<i class="cached" title="Block ', f' · free, cached&#10;ref count {rc} · {m}"></i>'
            return '<i title="Block ', f' · empty&#10;ref count {rc} · {m}"></i>'
        one, two, who = holders.groups[ow] if ow else _NO_OWNER
        if rc > 1:
            return (
                f'<i class="shared{two}" title="Block ',
                f' · shared by {rc}&#10;ref count {rc} · {m}{who}">{rc if rc < 100 else "99+"}</i>',
            )
        f = ""
        if filled < bs:  # partly written: fill level in eighths, rounded up so one token shows
            f = f" fill{min(FILL_LEVELS - 1, max(0, -(-filled * FILL_LEVELS // bs)))}"
        return f'<i class="used{one}{f}" title="Block ', f' · in use&#10;ref count {rc} · {m}{who}"></i>'

    templates: dict[tuple, tuple[str, str]] = {}
    parts: list[str] = []
    add = parts.append
    for b in blocks:
        ow = b.owners
        key = (b.ref_count, b.cached, b.filled, b.group, ow)
        t = templates.get(key)
        if t is None:
            t = templates[key] = template(key[0], key[1], key[2], ow, b.group)
        add(f"{t[0]}{b.id}{t[1]}")
    return "".join(parts)


def _chips(stats: EngineStats, tokens_per_s: float | None) -> str:
    """The counters above the grid."""
    used, cached_free, free = stats.used_blocks, stats.cached_blocks, stats.free_blocks
    hits, queries = stats.prefix_cache_hits, stats.prefix_cache_queries
    chips = [
        _chip(f"{used:,}", "used", "blocks held by running requests", "used"),
        _chip(
            f"{cached_free:,}",
            "cached",
            "free blocks that still hold a prefix; reused on a hit, evicted last",
            "cached",
        ),
        _chip(f"{free - cached_free:,}", "empty", "free blocks holding nothing", "empty"),
        _chip(f"{stats.num_blocks:,}", f"blocks × {stats.block_size} tokens", f"{free:,} free in all"),
        _chip(
            format_hit_rate(hits, queries),
            "prefix hits",
            f"prefix cache hits / queries, in tokens: {_fmt_num(hits)} / {_fmt_num(queries)}",
        ),
        _chip(f"{stats.num_preemptions:,}", "preemptions"),
        *([_groups_chip(stats)] if len(stats.kv_groups) > 1 else []),
        _chip(f"{stats.num_running} / {stats.num_waiting}", "running / waiting"),
    ]
    if tokens_per_s is not None:
        chips.append(_chip(f"{tokens_per_s:.1f}", "tok/s", "generated tokens per second"))
    if stats.speculative_method and stats.spec_steps:
        chips.append(
            _chip(
                f"{stats.spec_mean_accepted_length:.1f}",
                f"tok/step ({stats.speculative_method}, {stats.spec_acceptance_rate:.0%} accepted)",
                f"speculative decoding: {stats.spec_accepted_tokens:,} of {stats.spec_draft_tokens:,} drafted tokens "
                f"accepted over {stats.spec_steps:,} request-steps",
            )
        )
    return "".join(chips)


def _state_row(stats: EngineStats) -> str:
    """A hybrid model's recurrent-state slots, a row of their own under the blocks: one a running chat holds
    (whatever its length), then the prefix snapshots kept, then the free ones."""
    mib = stats.state_slot_bytes / 2**20
    running, snapshots = stats.used_state_slots, stats.state_snapshots
    cells = (
        '<i class="used own-none fill3"></i>' * running
        + "<i></i>" * (stats.num_state_slots - running)
        + '<i class="cached"></i>' * snapshots
        + "<i></i>" * (stats.num_snapshot_slots - snapshots)
    )
    tip = (
        f"recurrent state of the linear-attention layers, {mib:.1f} MiB a slot: {running} of "
        f"{stats.num_state_slots} chat slots in use, {snapshots} of {stats.num_snapshot_slots} prefix snapshots kept"
    )
    return (
        f'<p class="none">State slots ({running} chats, {snapshots} snapshots, {mib:.1f} MiB each)</p>'
        f'<div class="grid states" title="{escape(tip)}">{cells}</div>'
    )


def _groups_chip(stats: EngineStats) -> str:
    """The KV-cache groups of a model whose layers attend differently: what each holds, in its tooltip."""
    held = stats.used_blocks_per_group or (0,) * len(stats.kv_groups)
    lines = "\n".join(f"{i + 1}. {kind}: {n:,} blocks in use" for i, (kind, n) in enumerate(zip(stats.kv_groups, held)))
    tip = (
        f"a block holds the KV of one group's {stats.layers_per_block} layers; sliding-window groups give back "
        f"the blocks their window has passed\n{lines}"
    )
    return _chip(f"{len(stats.kv_groups)}", "KV-cache groups", tip)


def _usage_bar(stats: EngineStats) -> str:
    """The share of blocks in use and cached, as one bar."""
    used, cached_free = stats.used_blocks, stats.cached_blocks
    empty, total = stats.free_blocks - cached_free, max(stats.num_blocks, 1)
    return (
        f'<div class="bar" title="used {used:,} · cached {cached_free:,} · empty {empty:,}">'
        f'<span class="used" style="width:{min(100.0, 100 * used / total):.2f}%"></span>'
        f'<span class="cached" style="width:{min(100.0, 100 * cached_free / total):.2f}%"></span></div>'
    )


def _legend(holders: _Holders) -> str:
    """The conversations holding the most blocks, listed in a steady order so polls do not reshuffle them."""
    legend = []
    ranked = sorted(holders.blocks.items(), key=lambda kv: (-kv[1], kv[0]))
    for e, count in sorted(ranked[:MAX_LEGEND_ENTRIES], key=lambda kv: (kv[0][0], kv[0][1].casefold(), kv[0][1])):
        name = holders.display[e]
        legend.append(
            f'<span class="legend-entry" title="{name} · {count:,} blocks">'
            f'<i class="used own{holders.colour[e]}"></i><span class="legend-name">{name}</span></span>'
        )
    if len(ranked) > MAX_LEGEND_ENTRIES:
        legend.append(f'<span class="legend-entry more">+{len(ranked) - MAX_LEGEND_ENTRIES} more</span>')
    return "".join(legend)


# ---- remote servers ------------------------------------------------------------------------------
def _flatten(metrics: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows = []
    for k, v in metrics.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            rows.extend(_flatten(v, f"{name}."))
        else:
            rows.append((name, v))
    return rows


def _find(rows, *suffixes):
    for k, v in rows:
        key = k.lower().removesuffix("_total")
        if any(key.endswith(s) for s in suffixes) and isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


# Pagoda's names for what app.remote_metrics.summarize_metrics finds in a server's /metrics, as the table shows them.
REMOTE_LABELS = {
    "prefix_cache_queries": "prefix cache queries (tokens)",
    "prefix_cache_hits": "prefix cache hits (tokens)",
    "prefix_cache_hit_rate": "prefix cache hit rate",
    "num_requests_running": "requests running",
    "num_requests_waiting": "requests waiting",
    "kv_cache_usage": "KV cache in use",
}


def _percent(v) -> str:
    return f"{100.0 * v:.1f}%" if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else "—"


def render_remote_notice(metrics: dict | None, source: str = "") -> str:
    """What the KV panel shows for a remote OpenAI-compatible server: no blocks, only its metrics.

    metrics: app.remote_metrics.summarize_metrics's dict (any flat or nested dict of numbers is shown as a
    table); None or {} when the server has none. source: "model at url", shown in the notice."""
    rows = _flatten(metrics) if isinstance(metrics, dict) else []
    where = f" ({_ascii(escape(source))})" if source else ""
    parts = [
        f'<div class="pgd-kv remote"><p class="note"><b>Remote server</b>{where}. Block-level KV cache data is '
        "not available from a remote OpenAI-compatible server, so there is no block grid here."
    ]
    if not rows:
        parts.append(
            " This server exposes no metrics (Pagoda reads vLLM's, SGLang's and llama.cpp's from /metrics).</p></div>"
        )
        return "".join(parts)
    parts.append(" What its metrics say:</p>")
    chips = []
    hits, queries = _find(rows, "prefix_cache_hits"), _find(rows, "prefix_cache_queries")
    rate = _find(rows, "prefix_cache_hit_rate", "cache_hit_rate")
    if hits is not None and queries is not None:
        chips.append(
            _chip(
                format_hit_rate(hits, queries),
                "prefix hits",
                f"prefix cache hits / queries, in tokens: {_fmt_num(hits)} / {_fmt_num(queries)}",
            )
        )
    elif rate is not None:
        chips.append(_chip(_percent(rate), "prefix hits", "the server's prefix cache hit rate"))
    running, waiting = _find(rows, "num_requests_running"), _find(rows, "num_requests_waiting")
    if running is not None or waiting is not None:
        chips.append(
            _chip(
                f"{_fmt_num(running) if running is not None else '—'} / "
                f"{_fmt_num(waiting) if waiting is not None else '—'}",
                "running / waiting",
            )
        )
    usage = _find(rows, "kv_cache_usage")
    if usage is not None:
        chips.append(
            _chip(_percent(usage), "KV cache in use", "the share of the server's KV cache that holds requests")
        )
    if chips:
        parts.append(f'<div class="stats">{"".join(chips)}</div>')
    parts.append('<table class="metrics">')
    for k, v in rows[:MAX_REMOTE_ROWS]:
        label = REMOTE_LABELS.get(k, k)
        value = _percent(v) if k in ("prefix_cache_hit_rate", "kv_cache_usage") else _fmt_num(v)
        parts.append(f"<tr><th>{_ascii(escape(str(label)))}</th><td>{_ascii(escape(value))}</td></tr>")
    parts.append("</table>")
    if len(rows) > MAX_REMOTE_ROWS:
        parts.append(f'<p class="more">+{len(rows) - MAX_REMOTE_ROWS} more</p>')
    parts.append("</div>")
    return "".join(parts)
