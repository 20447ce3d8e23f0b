"""The structured output backend and the executor's matchers on the SmolLM2 tokenizer: the
bitmask applied only to the rows that need it, the sampler under it, compile errors naming the
field, the xgrammar -> llguidance fallback, replay after preemption and forks of n > 1."""

from __future__ import annotations

import threading

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from services.executor.sampler import Sampler
from services.executor.structured_output import StructuredOutputManager
from shared.messages import SamplingParams, StructuredOutputsParams
from shared.structured_output import (
    StructuredOutputBackend,
    StructuredOutputError,
    apply_token_bitmask,
    bitmask_words,
)

EOS = (2,)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(str(smollm2_path))


@pytest.fixture(scope="module")
def backend(tokenizer):
    return StructuredOutputBackend(tokenizer, 49152, EOS)


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    """The token ids ``bitmask[row]`` allows (bit t % 32 of word t // 32)."""
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def test_bitmask_applied_only_to_listed_rows():
    """Against xgrammar's own kernel on a full-batch mask; rows not listed are untouched, and a
    logits row wider than the mask (the model's padded vocabulary) forbids the extra ids."""
    gen = torch.Generator().manual_seed(0)
    vocab = 100
    logits = torch.randn(4, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, bitmask_words(vocab)), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask[[1, 3]], [1, 3])
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask, indices=[1, 3], backend="torch_native")
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(ours[[0, 2]], logits[[0, 2]])
    assert torch.isinf(ours[1]).sum() == sum(1 for t in range(vocab) if t not in allowed(bitmask, 1, vocab))
    wide = torch.zeros(1, 70)
    apply_token_bitmask(wide, torch.full((1, 1), -1, dtype=torch.int32), [0])  # mask covers 32 ids
    assert torch.isinf(wide[0, 32:]).all() and not torch.isinf(wide[0, :32]).any()


def test_sampler_masks_rows_and_keeps_raw_logits(monkeypatch):
    """The same tokens by torch's path (native kernels off: the C library is never asked for)
    and by the C kernel's (on, where the library loads)."""
    from kernels.cpu import sampling_ops

    def no_library(*args, **kwargs):
        raise AssertionError("the C kernel was asked for with native kernels off")

    vocab = 64
    logits = torch.arange(vocab, dtype=torch.float32).repeat(3, 1)  # argmax 63 everywhere
    raw = logits.clone()
    bitmask = torch.zeros(2, bitmask_words(vocab), dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # row 0: only token 5
    bitmask[1, 1] = 1 << 3  # row 2: only token 35
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1)]
    with monkeypatch.context() as m:
        m.setattr(sampling_ops, "apply_token_bitmask", no_library)
        tokens = Sampler(0, torch.device("cpu")).sample(logits, params, [None] * 3, bitmask=(bitmask, [0, 2]))
    assert tokens[:2] == [5, 63] and tokens[2] == 35
    assert torch.equal(logits, raw)  # the log probabilities are of the raw logits
    native = Sampler(0, torch.device("cpu"), native_kernels=True)
    assert native.sample(logits, params, [None] * 3, bitmask=(bitmask, [0, 2])) == tokens


def test_compile_errors_name_the_field_and_lark_falls_back(backend):
    with pytest.raises(StructuredOutputError) as info:
        backend.compile(StructuredOutputsParams(json={"type": "strin"}))
    assert info.value.param == "structured_outputs.json" and "strin" in str(info.value)
    with pytest.raises(StructuredOutputError, match=r"structured_outputs\.regex"):
        backend.compile(StructuredOutputsParams(regex="a(?=b)"))
    with pytest.raises(StructuredOutputError, match=r"structured_outputs\.grammar"):
        backend.compile(StructuredOutputsParams(grammar="root ::= "))
    assert backend.compile(StructuredOutputsParams(grammar='root ::= "a"')).backend == "xgrammar"
    assert backend.compile(StructuredOutputsParams(grammar='start: "a" | "b"')).backend == "guidance"
    so = StructuredOutputsParams(json={"type": "integer"})
    assert backend.compile(so) is backend.compile(StructuredOutputsParams(json='{"type":"integer"}'))  # cached


@pytest.mark.parametrize("spec", [StructuredOutputsParams(choice=["yes", "no"]),
                                  StructuredOutputsParams(grammar='start: "yes" | "no"')])  # xgrammar, llguidance
def test_matcher_allows_only_eos_when_complete(backend, tokenizer, spec):
    matcher = backend.matcher(backend.compile(spec))
    bitmask = torch.zeros(1, bitmask_words(49152), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    assert {tokenizer.decode([t]) for t in allowed(bitmask, 0, 49152)} >= {"yes", "no"}
    assert all(matcher.accept_token(t) for t in tokenizer.encode("yes"))
    matcher.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0, 49152) == [2]
    assert not matcher.is_terminated()  # complete, but no stop token yet
    assert matcher.accept_token(2) and matcher.is_terminated()
    matcher.fill_bitmask(bitmask, 0)  # a token computed after EOS (async scheduling) is dropped anyway
    assert allowed(bitmask, 0, 49152) == [2]
    assert not matcher.accept_token(5)
    refused = backend.matcher(backend.compile(spec))
    assert not refused.accept_token(tokenizer.encode("maybe")[0])
    assert not refused.is_terminated()  # a refused token is no end of the grammar (llguidance's error state)


def test_manager_replays_forks_and_masks_only_its_rows(smollm2_path, tokenizer):
    manager = StructuredOutputManager(smollm2_path, 49152, EOS)
    regex = StructuredOutputsParams(regex="(abc|abd)e")
    a = tokenizer.encode("ab")
    manager.add("r", regex, [])
    manager.add("resumed", regex, a)  # recomputed after preemption: its outputs replayed
    mask, rows = manager.bitmask(["free", "r", "resumed"])
    assert rows == [1, 2] and mask.shape == (2, 1536)
    assert allowed(mask, 1, 49152) != allowed(mask, 0, 49152)
    manager.accept(["free", "r", "resumed"], [7, a[0], tokenizer.encode("d")[0]])
    manager.fork("resumed", "resumed#1")  # a sample starts from its parent's tokens
    mask, rows = manager.bitmask(["resumed", "resumed#1"])
    assert allowed(mask, 0, 49152) == allowed(mask, 1, 49152) == tokenizer.encode("e")
    manager.remove("resumed#1")
    assert manager.bitmask(["resumed#1", "free"]) is None


def test_slow_prepare_does_not_hold_up_a_request_and_close_cancels(smollm2_path):
    """A scheduler's compile (``prepare``) still running, a new request's grammar is compiled
    anyway (its own thread); ``close`` cancels what is queued and refuses new work."""
    manager = StructuredOutputManager(smollm2_path, 49152, EOS)
    release = threading.Event()
    slow, fast = StructuredOutputsParams(regex="slow"), StructuredOutputsParams(regex="fast")

    def compile_(params):
        if params == slow:
            assert release.wait(30)
        return params

    manager._compile = compile_
    running = manager.prepare(slow)
    queued = manager.prepare(StructuredOutputsParams(regex="queued"))
    manager.add("r", fast, [])
    assert manager._entries["r"].grammar.result(timeout=30) == fast
    assert not running.done()
    manager.close()
    assert queued.cancelled()
    release.set()
    assert running.result(timeout=30) == slow  # the running compile ends on its own
    with pytest.raises(RuntimeError):
        manager.prepare(fast)


def test_bitmask_skips_a_request_removed_meanwhile(smollm2_path):
    manager = StructuredOutputManager(smollm2_path, 49152, EOS)
    manager.add("r", StructuredOutputsParams(regex="ab"), [])
    manager.add("gone", StructuredOutputsParams(regex="ab"), [])
    entries = manager._entries

    class Vanishing(dict):  # "gone" is removed (the runner's recovery) after the rows are chosen
        def get(self, key, default=None):
            value = super().get(key, default)
            if key == "gone" and value is not None:
                self.pop("gone")
            return value

    manager._entries = Vanishing(entries)
    mask, rows = manager.bitmask(["gone", "r"])
    assert rows == [1] and mask.shape == (1, 1536)
    manager.close()
