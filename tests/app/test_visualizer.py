"""The KV cache visualizer renders kv_blocks()/stats() into HTML: parse it back and check what it says."""

import dataclasses
import json
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from app.visualizer import (
    assign_colours,
    colour_index,
    format_hit_rate,
    render_kv_cache,
    render_remote_notice,
    visualizer_css,
)
from engine.front.outputs import EngineStats, KVBlock

BS = 16


class Grid(HTMLParser):
    """Collects the grid's blocks (the <i> children of div.grid), the legend entries and all text."""

    def __init__(self, html: str):
        super().__init__()
        self.blocks: list[dict] = []
        self.legend: list[dict] = []
        self.text: list[str] = []
        self.stack: list[tuple[str, set[str]]] = []
        self.current = None
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        in_grid = any(t == "div" and "grid" in c for t, c in self.stack)
        if tag == "i" and in_grid:
            self.current = {"classes": classes, "title": a.get("title", ""), "text": "", "attrs": a}
            self.blocks.append(self.current)
        elif tag == "span" and "legend-entry" in classes:
            self.current = {"classes": classes, "title": a.get("title", ""), "text": "", "swatch": None}
            self.legend.append(self.current)
        elif tag == "i" and self.legend and self.current is self.legend[-1]:
            self.current["swatch"] = classes
        self.stack.append((tag, classes))

    def handle_endtag(self, tag):
        while self.stack:
            t, _ = self.stack.pop()
            if t == tag:
                break
        if tag in ("i", "span") and self.current is not None and (tag == "i") == ("attrs" in self.current):
            self.current = None

    def handle_data(self, data):
        self.text.append(data)
        if self.current is not None:
            self.current["text"] += data

    @property
    def all_text(self) -> str:
        return " ".join(self.text)


def colour_of(classes: set[str]) -> str:
    """The owner colour class of an element: own0..own11, or own-none."""
    return next(c for c in classes if c.startswith("own") and (c[3:].isdigit() or c == "own-none"))


def block(i, ref_count=0, cached=False, filled=0, owners=()):
    return KVBlock(id=i, ref_count=ref_count, cached=cached, filled=filled, owners=tuple(owners))


def engine_stats(**fields) -> EngineStats:
    """An EngineStats with an empty 12-block cache's counters, and the given fields instead."""
    defaults = dict(
        num_blocks=12,
        free_blocks=12,
        cached_blocks=0,
        used_blocks=0,
        block_size=BS,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_running=2,
        num_waiting=0,
        num_preemptions=0,
        num_generated_tokens=0,
        max_model_len=2048,
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        matmul="torch",
        quantization="none",
        sampler="eager",
        decode="eager",
        async_scheduling=False,
        tensor_parallel_size=1,
    )
    return EngineStats(**{**defaults, **fields})


def stats_for(blocks, **extra) -> EngineStats:
    """The counters the engine would report for these blocks."""
    used = sum(b.ref_count > 0 for b in blocks)
    cached = sum(b.ref_count == 0 and b.cached for b in blocks)
    return engine_stats(
        **{
            "num_blocks": len(blocks),
            "free_blocks": len(blocks) - used,
            "cached_blocks": cached,
            "used_blocks": used,
            **extra,
        }
    )


def two_chats():
    """Two chats share a 3-block system prompt; each has its own blocks; some cached-free, some empty."""
    blocks = [block(i, 2, True, BS, ["req-a", "req-b"]) for i in range(3)]
    blocks += [block(3, 1, True, BS, ["req-a"]), block(4, 1, False, 5, ["req-a"])]
    blocks += [block(5, 1, False, 11, ["req-b"])]
    blocks += [block(6, 0, True, BS), block(7, 0, True, BS)]
    blocks += [block(i) for i in range(8, 12)]
    owners = {"req-a": "Trip planning", "req-b": "Rust questions"}
    return blocks, owners


def render(blocks, owners=None, **stats):
    return Grid(render_kv_cache(blocks, stats_for(blocks, **stats), owners))


def test_one_element_per_block_in_order():
    blocks, owners = two_chats()
    g = render(blocks, owners)
    assert len(g.blocks) == len(blocks)
    for b, el in zip(blocks, g.blocks, strict=True):
        assert el["title"].startswith(f"Block {b.id} ")


def test_shared_blocks_show_ref_count_and_marker():
    blocks, owners = two_chats()
    blocks[1] = dataclasses.replace(blocks[1], ref_count=5)
    g = render(blocks, owners)
    for i, rc in [(0, 2), (1, 5), (2, 2)]:
        el = g.blocks[i]
        assert "shared" in el["classes"], el
        assert el["text"] == str(rc)
        assert f"shared by {rc}" in el["title"] and f"ref count {rc}" in el["title"]
    for el in g.blocks[3:]:  # nothing else is marked shared or carries a number
        assert "shared" not in el["classes"] and el["text"] == ""


def test_huge_ref_count_stays_short_in_the_square():
    g = render([block(0, 250, True, BS, [f"r{i}" for i in range(250)])])
    assert g.blocks[0]["text"] == "99+" and "ref count 250" in g.blocks[0]["title"]
    assert "+244 more" in g.blocks[0]["title"]  # six labels, then a count


def test_cached_free_and_empty_look_different():
    blocks, owners = two_chats()
    g = render(blocks, owners)
    cached_free, empty = g.blocks[6], g.blocks[8]
    assert cached_free["classes"] != empty["classes"]
    assert "cached" in cached_free["classes"] and "free, cached" in cached_free["title"]
    assert not empty["classes"] & {"cached", "used", "shared"} and "empty" in empty["title"]
    assert "not cached" in empty["title"]


def test_two_conversations_get_different_colours_and_shared_block_names_both():
    blocks, owners = two_chats()
    g = render(blocks, owners)
    a, b = colour_of(g.blocks[3]["classes"]), colour_of(g.blocks[5]["classes"])
    assert a != b and "own-none" not in (a, b)
    assert "used" in g.blocks[3]["classes"] and "used" in g.blocks[5]["classes"]
    shared = g.blocks[0]
    assert "shared" in shared["classes"]
    assert "Trip planning" in shared["title"] and "Rust questions" in shared["title"]
    # the shared block stripes both conversations' colours
    assert colour_of(shared["classes"]) in (a, b)
    assert {"also" + a[3:], "also" + b[3:]} & shared["classes"]
    # the legend lists both conversations with their colours, plus the block kinds
    legend = {e["text"]: e["swatch"] for e in g.legend}
    assert colour_of(legend["Trip planning"]) == a and colour_of(legend["Rust questions"]) == b
    assert any("free, cached" in t for t in legend) and any("empty" == t for t in legend)


def test_colours_are_stable_and_distinct_among_labels_present():
    labels = [f"chat {i}" for i in range(12)]
    slots = assign_colours(labels)
    assert sorted(slots.values()) == list(range(12))  # 12 labels, 12 colours: no collision survives
    assert assign_colours(reversed(labels)) == slots  # independent of order
    # a label alone always gets its preferred colour, in every render
    g1 = render([block(0, 1, False, 3, ["x"])], {"x": "Solo"})
    assert colour_of(g1.blocks[0]["classes"]) == f"own{colour_index('Solo')}"


# Palette slots that must never change: a chat keeps its colour across restarts and machines. Python's str hash()
# is salted per process (PYTHONHASHSEED), so a digest built on it would break these.
PINNED_SLOTS = {"Solo": 5, "Trip planning": 0, "Rust questions": 9, "chat 0": 6, "chat 7": 10, "旅行の計画 🗾": 9}


def test_colour_slots_are_pinned_in_this_and_other_processes():
    assert {label: colour_index(label) for label in PINNED_SLOTS} == PINNED_SLOTS
    code = (
        "import json, sys; from app.visualizer import colour_index; "
        "print(json.dumps({s: colour_index(s) for s in json.loads(sys.argv[1])}))"
    )
    for seed in ("0", "271828"):
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(list(PINNED_SLOTS))],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[2],
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert json.loads(out.stdout) == PINNED_SLOTS, seed


def test_partly_filled_blocks_show_their_fill_level():
    blocks = [
        block(0, 1, False, 1, ["r"]),
        block(1, 1, False, 8, ["r"]),
        block(2, 1, False, 15, ["r"]),
        block(3, 1, False, BS, ["r"]),
        block(4, 1, False, 0, ["r"]),
    ]
    g = render(blocks, {"r": "chat"})
    fills = [{c for c in el["classes"] if c.startswith("fill")} for el in g.blocks]
    assert fills == [{"fill1"}, {"fill4"}, {"fill7"}, set(), {"fill0"}]


def test_unknown_request_ids_are_neutral_and_labelled_by_id():
    g = render([block(0, 1, False, 4, ["cmpl-42"]), block(1, 1, False, 4, ["req-a"])], {"req-a": "Known"})
    assert colour_of(g.blocks[0]["classes"]) == "own-none"
    assert "request cmpl-42" in g.blocks[0]["title"]
    assert colour_of(g.blocks[1]["classes"]) != "own-none"
    assert any(e["text"] == "request cmpl-42" and colour_of(e["swatch"]) == "own-none" for e in g.legend)


def test_labels_are_escaped():
    evil = '<script>alert("x")</script> & "quotes"'
    blocks = [block(0, 2, True, BS, ["a", "b"]), block(1, 1, False, 2, ["a"])]
    html = render_kv_cache(blocks, stats_for(blocks), {"a": evil, "b": "<img src=x onerror=alert(1)>"})
    assert "<script" not in html and "<img" not in html and 'alert("x")' not in html
    g = Grid(html)
    assert evil in g.blocks[0]["title"] and "<img src=x onerror=alert(1)>" in g.blocks[0]["title"]
    assert evil in g.blocks[1]["title"]
    assert any(e["text"] == evil for e in g.legend)
    # request ids are user-reachable through the API: escaped too
    blocks = [block(0, 1, False, 1, ["<b>id</b>"])]
    html = render_kv_cache(blocks, stats_for(blocks), {})
    assert "<b>id" not in html and "request <b>id</b>" in Grid(html).blocks[0]["title"]


def test_wide_characters_survive_as_references():
    blocks = [block(0, 1, False, 3, ["r"])]
    html = render_kv_cache(blocks, stats_for(blocks), {"r": "旅行の計画 🗾"})
    assert html.isascii() or max(map(ord, html)) < 256  # stored compactly
    g = Grid(html)
    assert "旅行の計画 🗾" in g.blocks[0]["title"]
    assert any(e["text"] == "旅行の計画 🗾" for e in g.legend)


def test_tooltip_content():
    blocks, owners = two_chats()
    g = render(blocks, owners)
    t = g.blocks[4]["title"]  # chat A's partial tail block
    assert t.splitlines() == ["Block 4 · in use", f"ref count 1 · 5/{BS} tokens · not cached", "owner: Trip planning"]
    t = g.blocks[0]["title"]
    assert t.splitlines() == [
        "Block 0 · shared by 2",
        f"ref count 2 · {BS}/{BS} tokens · cached",
        "owners: Trip planning, Rust questions",
    ]
    assert g.blocks[6]["title"].splitlines() == ["Block 6 · free, cached", f"ref count 0 · {BS}/{BS} tokens · cached"]
    assert g.blocks[9]["title"].splitlines() == ["Block 9 · empty", f"ref count 0 · 0/{BS} tokens · not cached"]


def test_blocks_in_use_without_a_running_owner():
    g = render([block(0, 1, True, BS)])
    assert colour_of(g.blocks[0]["classes"]) == "own-none" and "owner: none running" in g.blocks[0]["title"]


@pytest.mark.parametrize(
    "hits,queries,expected",
    [(0, 0, "—"), (5, 0, "—"), (0, 100, "0.0%"), (1, 3, "33.3%"), (50, 50, "100.0%"), (None, None, "—")],
)
def test_hit_rate_formatting(hits, queries, expected):
    assert format_hit_rate(hits, queries) == expected


def test_header_counts():
    blocks, owners = two_chats()
    html = render_kv_cache(
        blocks,
        stats_for(
            blocks, prefix_cache_queries=400, prefix_cache_hits=48, num_running=2, num_waiting=3, num_preemptions=7
        ),
        owners,
        tokens_per_s=41.66,
    )
    text = " ".join(Grid(html).all_text.split())
    for expected in [
        "6 used",
        "2 cached",
        "4 empty",
        f"12 blocks × {BS} tokens",
        "12.0% prefix hits",
        "7 preemptions",
        "2 / 3 running / waiting",
        "41.7 tok/s",
    ]:
        assert expected in text, (expected, text)
    text = " ".join(Grid(render_kv_cache(blocks, stats_for(blocks), owners)).all_text.split())
    assert "— prefix hits" in text and "tok/s" not in text


def test_counters_come_from_stats_not_from_recounting_blocks():
    # kv_blocks() and stats() are two calls: the header shows the engine's counters even if the blocks moved between.
    blocks, owners = two_chats()
    stats = engine_stats(num_blocks=12, free_blocks=5, cached_blocks=3, used_blocks=7)
    text = " ".join(Grid(render_kv_cache(blocks, stats, owners)).all_text.split())
    assert "7 used" in text and "3 cached" in text and "2 empty" in text


def test_no_blocks():
    html = render_kv_cache([], engine_stats(num_blocks=0, free_blocks=0, num_running=0), None)
    g = Grid(html)
    assert g.blocks == [] and "No KV cache yet" in g.all_text


def test_output_per_block_is_small_for_20000_blocks():
    n = 20000
    blocks = []
    for i in range(n):
        kind = i % 10
        if kind < 2:
            blocks.append(block(i, 3, True, BS, [f"req-{i % 7}", f"req-{(i + 1) % 7}", f"req-{(i + 2) % 7}"]))
        elif kind < 6:
            blocks.append(block(i, 1, kind == 2, BS if kind != 5 else 7, [f"req-{i % 40}"]))
        elif kind < 8:
            blocks.append(block(i, 0, True, BS))
        else:
            blocks.append(block(i))
    owners = {f"req-{k}": f"Conversation about topic number {k}" for k in range(40)}
    html = render_kv_cache(blocks, stats_for(blocks), owners, tokens_per_s=100.0)
    g = Grid(html)
    assert len(g.blocks) == n
    assert len(html) / n < 200, len(html) / n
    assert "style=" not in html.split('class="grid ')[1]  # no per-block inline styles
    # the markup is tiny: <i class="..." title="...">n</i> and nothing else per block
    assert all(set(el["attrs"]) <= {"class", "title"} for el in g.blocks[:200])


def test_css_asset():
    css = visualizer_css()
    assert ".pgd-kv" in css and ".dark .pgd-kv" in css
    for cls in [
        "i.cached",
        "i.used",
        "i.shared",
        ".own0",
        ".own11",
        ".own-none",
        ".also11",
        ".also-none",
        ".fill7",
        ".grid.size1",
        ".grid.size4",
        ".legend-entry",
    ]:
        assert cls in css, cls


def test_remote_notice():
    html = render_remote_notice(
        {
            "vllm:prefix_cache_hits_total": 30,
            "vllm:prefix_cache_queries_total": 120,
            "num_requests_running": 2,
            "model": "<evil>",
            "cache": {"usage": 0.25},
        }
    )
    g = Grid(html)
    text = " ".join(g.all_text.split())
    assert "not available" in text and "remote" in text.lower()
    assert "25.0% prefix hits" in text
    assert "vllm:prefix_cache_hits_total 30" in text and "cache.usage 0.25" in text
    assert "<evil>" not in html and "<evil>" in text
    for empty in (None, {}):
        text = Grid(render_remote_notice(empty)).all_text
        assert "not available" in text and "no metrics" in text


def test_a_model_with_kv_cache_groups_says_which_group_each_block_holds():
    """Gemma 3's layers attend in two ways: its blocks belong to KV-cache groups, and the view says so."""
    blocks = [KVBlock(0, 1, True, BS, ("req-a",), 0), KVBlock(1, 1, False, 3, ("req-a",), 1), block(2)]
    g = render(
        blocks,
        {"req-a": "Long chat"},
        kv_groups=("sliding 1024", "full"),
        used_blocks_per_group=(1, 1),
        layers_per_block=5,
    )
    assert "KV-cache group 1 (sliding 1024)" in g.blocks[0]["title"]
    assert "KV-cache group 2 (full)" in g.blocks[1]["title"]
    assert "group" not in g.blocks[2]["title"]  # an empty block belongs to none
    assert "2  KV-cache groups" in g.all_text
    plain = render(blocks, {"req-a": "Long chat"})  # one group: nothing about groups
    assert "group" not in plain.all_text and all("group" not in b["title"] for b in plain.blocks)


def test_a_hybrid_models_state_slots_are_a_row_of_their_own():
    """Qwen3.5's chats each hold a state slot whatever their length, and the prefix snapshots take slots too."""
    blocks = [block(0, 1, False, 5, ["req-a"]), block(1)]
    stats = stats_for(
        blocks,
        state_slot_bytes=49 << 20,
        used_state_slots=1,
        state_snapshots=2,
        num_state_slots=3,
        num_snapshot_slots=4,
    )
    html = render_kv_cache(blocks, stats)
    row = html.split('<div class="grid states"')[1].split("</div>")[0]
    assert row.count('class="used') == 1 and row.count('class="cached"') == 2 and row.count("<i></i>") == 4
    assert "1 of 3 chat slots in use, 2 of 4 prefix snapshots kept" in row and "49.0 MiB" in row
    assert '<div class="grid states"' not in render_kv_cache(blocks, stats_for(blocks))


def test_speculative_decoding_shows_tokens_per_step_and_acceptance():
    blocks, owners = two_chats()
    plain = render_kv_cache(blocks, stats_for(blocks), owners)
    assert "tok/step" not in plain
    stats = stats_for(blocks, speculative_method="ngram", spec_steps=10, spec_draft_tokens=40, spec_accepted_tokens=16)
    html = render_kv_cache(blocks, stats, owners)
    assert "<b>2.6</b> tok/step (ngram, 40% accepted)" in html
    assert "16 of 40 drafted tokens accepted over 10 request-steps" in html
