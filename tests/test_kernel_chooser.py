"""engine/quantization/chooser.py: each weight's kernel is measured on a proxy of sampled rows, built over the whole
weight only once it is chosen, checked there (over its first thousands of rows and sampled ones for the first weight of
a shape and layout, over the sampled rows for the others), and measured once per shape and layout (issue 38: building
every candidate over the whole weight made loading a GGUF file take several times its size)."""

import logging

import pytest
import torch
from torch import nn

from engine.quantization import chooser
from engine.quantization.chooser import choose_matmul, sampled_rows
from engine.quantization.kernels import DequantMatmul
from tests.quantized_weights import random_quantized_weight as make_weight

CPU = torch.device("cpu")
N, K, PROXY_ROWS = 1024, 256, 64


@pytest.fixture
def small_proxies(monkeypatch):
    """Fresh choices, and proxies of PROXY_ROWS rows of the weights here."""
    monkeypatch.setattr(chooser, "_CHOICES", {})
    monkeypatch.setattr(chooser, "_PREFILL_CHOICES", {})
    monkeypatch.setattr(chooser, "_CHECKED_WIDE", set())
    monkeypatch.setattr(chooser, "PROXY_VALUES", PROXY_ROWS * K)


def recording(built: list[tuple[str, int]]):
    """A `chooser.candidates` offering the real kernels, recording (name, rows) of every one built."""
    real = chooser.candidates

    def candidates(qw, device, dtype):
        def recorded(name, build):
            def build_and_record(w):
                built.append((name, w.shape[0]))
                return build(w)

            return build_and_record

        return {name: recorded(name, build) for name, build in real(qw, device, dtype).items()}

    return candidates


def test_sampled_rows_span_the_weight_from_first_to_last():
    n, k = 150_000, 4096  # a token table's shape
    rows = sampled_rows(n, k)
    assert rows is not None and rows[0] == 0 and rows[-1] == n - 1 and torch.all(rows[1:] > rows[:-1])
    assert 64 <= len(rows) * k <= 2 * chooser.PROXY_VALUES
    assert len(sampled_rows(n, 1 << 20)) == 64  # at least 64 rows, however wide
    assert sampled_rows(256, 4096) is None  # small enough to be its own proxy


def test_only_the_chosen_kernel_is_built_over_the_whole_weight(monkeypatch, small_proxies):
    built = []
    monkeypatch.setattr(chooser, "candidates", recording(built))
    qw = make_weight(4, N, K, 32, with_offset=True)
    kernel = choose_matmul(qw, CPU, torch.float32)
    names = set(chooser.candidates(qw, CPU, torch.float32))
    assert len(names) >= 2 and {name for name, _ in built} == names  # every candidate was measured...
    assert [(name, rows) for name, rows in built if rows > PROXY_ROWS] == [(type(kernel).__name__, N)]  # ...on rows
    x = torch.randn(3, K)
    torch.testing.assert_close(
        kernel(x), x @ qw.dequantize().T, atol=0.02 * (x @ qw.dequantize().T).abs().max(), rtol=0
    )

    built.clear()  # another layer of this shape and layout: the choice stands, nothing is measured again
    again = choose_matmul(make_weight(4, N, K, 32, with_offset=True, seed=1), CPU, torch.float32)
    assert built == [(type(kernel).__name__, N)] and type(again) is type(kernel)


class _WrongOffTheProxy(nn.Module):
    """Right on every row a proxy samples, wrong on one it leaves out (a packing bug in a slab the proxy missed)."""

    def __init__(self, qw, row: int):
        super().__init__()
        self.w, self.row = qw.dequantize(), row if qw.shape[0] == N else None

    def forward(self, x):
        y = x.float() @ self.w.T
        if self.row is not None:
            y[..., self.row] += 100
        return y


def test_a_kernel_right_on_the_proxy_but_wrong_elsewhere_is_not_kept(monkeypatch, small_proxies, caplog):
    qw = make_weight(4, N, K, 32, with_offset=True)
    missed = next(r for r in range(N) if r not in set(sampled_rows(N, K).tolist()))
    monkeypatch.setattr(
        chooser,
        "candidates",
        lambda qw, device, dtype: {
            "wrong": lambda w: _WrongOffTheProxy(w, missed),
            "DequantMatmul": lambda w: DequantMatmul(w, dtype),
        },
    )
    monkeypatch.setattr(
        chooser,
        "_seconds_per_call",  # the broken kernel measures fastest
        lambda kernel, x, calls=20: 0.5 if isinstance(kernel, _WrongOffTheProxy) else 1.0,
    )
    with caplog.at_level(logging.WARNING, logger="engine"):
        kernel = choose_matmul(qw, CPU, torch.float32)
    assert isinstance(kernel, DequantMatmul)
    assert "wrong agreed on sampled rows" in caplog.text


def test_the_first_weights_check_spans_its_first_rows_and_reaches_the_last():
    rows = chooser.checked_rows(150_000, wide=True)  # a token table: its first rows, then spread ones to the end
    assert rows[: chooser.WIDE_CHECK_ROWS].tolist() == list(range(chooser.WIDE_CHECK_ROWS)) and rows[-1] == 149_999
    assert len(rows) < chooser.WIDE_CHECK_ROWS + chooser.CHECK_ROWS and torch.all(rows[1:] > rows[:-1])
    assert chooser.checked_rows(100, wide=True).tolist() == list(range(100))


def test_later_weights_of_a_shape_are_checked_on_sampled_rows_and_still_refused_when_wrong(
    monkeypatch, small_proxies, caplog
):
    """Decoding every weight whole for its check cost most of a 4B file's load; the first of a shape and layout is
    checked over its first WIDE_CHECK_ROWS rows (here all) and CHECK_ROWS spread to the last, the others over the
    spread rows, which still catch a wrong kernel."""
    checked = []
    real_exact = chooser.exact_product
    monkeypatch.setattr(
        chooser, "exact_product", lambda qw, x, rows=None: checked.append(rows) or real_exact(qw, x, rows)
    )
    first = choose_matmul(make_weight(4, N, K, 32, with_offset=True), CPU, torch.float32)
    second = choose_matmul(make_weight(4, N, K, 32, with_offset=True, seed=1), CPU, torch.float32)
    assert type(second) is type(first)
    assert checked[0].tolist() == list(range(N)) and len(checked[1]) == chooser.CHECK_ROWS and checked[1][-1] == N - 1

    chosen = type(first).__name__  # now wrong on the last row, which the sampled check includes
    real = chooser.candidates
    monkeypatch.setattr(
        chooser,
        "candidates",
        lambda qw, device, dtype: {
            name: (lambda w: _WrongOffTheProxy(w, N - 1)) if name == chosen else build
            for name, build in real(qw, device, dtype).items()
        },
    )
    with caplog.at_level(logging.WARNING, logger="engine"):
        third = choose_matmul(make_weight(4, N, K, 32, with_offset=True, seed=2), CPU, torch.float32)
    assert not isinstance(third, _WrongOffTheProxy)
    assert "off by" in caplog.text and f"{chooser.CHECK_ROWS} of its {N} rows" in caplog.text
