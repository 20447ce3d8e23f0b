"""Tensor parallelism's parts: the partition of heads and sizes over the ranks, each parallel
layer's share of a checkpoint tensor (read as a slice), and the group's collectives between
real processes (gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from services.executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from services.executor.model_loader.loader import open_safetensors
from services.executor.parallel.group import TensorParallelGroup, current_tp_group, use_tp_group
from services.executor.parallel.partition import HeadShard, attention_heads, balanced_range
from shared.nats_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_balanced_ranges_cover_everything_once_and_differ_by_at_most_one():
    assert [balanced_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert [balanced_range(49152, 2, r) for r in range(2)] == [(0, 24576), (24576, 24576)]
    with pytest.raises(ValueError, match="part 2 of 2"):
        balanced_range(10, 2, 2)


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "expected"), [
    (9, 3, 3, [HeadShard(0, 3, 0, 1), HeadShard(3, 3, 1, 1), HeadShard(6, 3, 2, 1)]),  # SmolLM2 at TP=3
    (9, 3, 2, [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]),  # SmolLM2 at TP=2: whole KV groups, 2 + 1
    (8, 2, 2, [HeadShard(0, 4, 0, 1), HeadShard(4, 4, 1, 1)]),
    (8, 2, 4, [HeadShard(0, 2, 0, 1, 2), HeadShard(2, 2, 0, 1, 2), HeadShard(4, 2, 1, 1, 2),
               HeadShard(6, 2, 1, 1, 2)]),  # fewer KV heads than ranks: each replicated on 2 ranks
    (4, 1, 2, [HeadShard(0, 2, 0, 1, 2), HeadShard(2, 2, 0, 1, 2)]),  # multi-query
])
def test_attention_heads_split_by_whole_kv_groups_or_replicate_kv_heads(heads, kv_heads, tp, expected):
    shards = [attention_heads(heads, kv_heads, tp, r) for r in range(tp)]
    assert shards == expected
    group = heads // kv_heads
    covered = [h for s in shards for h in range(s.q_start, s.q_start + s.num_heads)]
    assert covered == list(range(heads))  # every query head on exactly one rank
    for s in shards:  # ... the rank holding the KV head it reads, in plain GQA order
        assert all(s.kv_start <= h // group < s.kv_start + s.num_kv_heads
                   for h in range(s.q_start, s.q_start + s.num_heads))
        assert s.num_heads % s.num_kv_heads == 0


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(9, 3, 4), (9, 3, 6), (8, 2, 16), (4, 4, 8)])
def test_heads_that_cannot_be_split_are_refused_naming_the_numbers(heads, kv_heads, tp):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} cannot split {heads} attention heads "
                                         f"with {kv_heads} KV heads"):
        attention_heads(heads, kv_heads, tp, 0)


def _rank(rank: int, world: int = 2) -> TensorParallelGroup:
    return TensorParallelGroup(rank, world)  # sizes only: no process group behind it


def test_layers_built_under_a_group_hold_their_rank_share_and_recombine_to_the_whole(tmp_path):
    """Each rank's parameters are its slice of the checkpoint tensor, read through
    ``narrow``; the ranks' column-parallel outputs concatenated, and their row-parallel
    partial outputs summed, are the whole layer's."""
    torch.manual_seed(0)
    hidden, head, heads, kv_heads, inter, vocab = 16, 2, 9, 3, 10, 11
    tensors = {
        "q": torch.randn(heads * head, hidden), "k": torch.randn(kv_heads * head, hidden),
        "v": torch.randn(kv_heads * head, hidden), "gate": torch.randn(inter, hidden),
        "up": torch.randn(inter, hidden), "down": torch.randn(hidden, inter),
        "o": torch.randn(hidden, heads * head), "embed": torch.randn(vocab, hidden),
    }
    save_file(tensors, tmp_path / "w.safetensors")
    x = torch.randn(5, hidden)
    with open_safetensors(tmp_path / "w.safetensors") as ckpt:
        qkv_out, gate_up_out, down_sum, o_sum, logits = {}, {}, 0, 0, []
        for rank in range(2):
            with use_tp_group(_rank(rank)):
                qkv = QKVParallelLinear(hidden, head, heads, kv_heads)
                gate_up = MergedColumnParallelLinear(hidden, [inter, inter])
                down = RowParallelLinear(inter, hidden, input_range=gate_up.row_ranges[0])
                o = RowParallelLinear(heads * head, hidden, input_range=qkv.row_ranges[0])
                lm_head = ParallelLMHead(vocab, hidden)
                embed = VocabParallelEmbedding(vocab, hidden)
            assert current_tp_group().world_size == 1  # outside the block: a single rank again
            for shard in ("q", "k", "v"):
                qkv.weight_loader(qkv.weight, ckpt[shard], shard)
            gate_up.weight_loader(gate_up.weight, ckpt["gate"], 0)
            gate_up.weight_loader(gate_up.weight, ckpt["up"], 1)
            down.weight_loader(down.weight, ckpt["down"])
            o.weight_loader(o.weight, ckpt["o"])
            lm_head.weight_loader(lm_head.weight, ckpt["embed"])
            embed.weight_loader(embed.weight, ckpt["embed"])
            assert (qkv.num_heads, qkv.num_kv_heads) == ((6, 2), (3, 1))[rank]
            qkv_out[rank] = qkv(x)
            gate_up_out[rank] = gate_up(x)
            down_sum = down_sum + F.linear(gate_up_out[rank][:, : gate_up.output_partition_sizes[0]], down.weight)
            q_rank = qkv_out[rank][:, : qkv.q_size]
            o_sum = o_sum + F.linear(q_rank, o.weight)
            logits.append(F.linear(x, lm_head.weight))
            start, size = embed.vocab_start, embed.num_embeddings_per_partition
            assert torch.equal(embed.weight, tensors["embed"][start : start + size])
    # float32 GEMMs of different widths may sum in other orders (AVX-512 Zen 4: the last bit),
    # so the recombined outputs are compared to float32 rounding; a wrong shard is far off
    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    q, k, v = (F.linear(x, tensors[n]) for n in "qkv")
    q_size = [6 * head, 3 * head]
    same(torch.cat([qkv_out[r][:, : q_size[r]] for r in range(2)], 1), q)
    same(torch.cat([qkv_out[r][:, q_size[r] : q_size[r] + (2, 1)[r] * head] for r in range(2)], 1), k)
    same(torch.cat([qkv_out[r][:, q_size[r] + (2, 1)[r] * head :] for r in range(2)], 1), v)
    gate = torch.cat([gate_up_out[r][:, :5] for r in range(2)], 1)
    up = torch.cat([gate_up_out[r][:, 5:] for r in range(2)], 1)
    same(gate, F.linear(x, tensors["gate"]))
    same(up, F.linear(x, tensors["up"]))
    torch.testing.assert_close(down_sum, F.linear(gate, tensors["down"]))
    torch.testing.assert_close(o_sum, F.linear(q, tensors["o"]))
    same(torch.cat(logits, 1), F.linear(x, tensors["embed"]))


def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused_before_it_is_read(tmp_path):
    save_file({"w": torch.randn(7, 16)}, tmp_path / "w.safetensors")
    with open_safetensors(tmp_path / "w.safetensors") as ckpt, use_tp_group(_rank(1)):
        layer = RowParallelLinear(8, 7)
        with pytest.raises(ValueError, match=r"checkpoint shape \(7, 16\) != expected \(7, 8\)"):
            layer.weight_loader(layer.weight, ckpt["w"])


def test_a_checkpoint_tensor_is_read_in_chunks_rows_and_columns(tmp_path, monkeypatch):
    """The pread reader gives safetensors' values: whole, a row range, a column range, and
    copied into a parameter of another dtype in chunks smaller than the tensor."""
    from services.executor.model_loader import loader

    tensors = {"f32": torch.randn(37, 12), "bf16": torch.randn(5, 3, 4).to(torch.bfloat16), "i64": torch.arange(3)}
    save_file(tensors, tmp_path / "w.safetensors")
    monkeypatch.setattr(loader, "READ_CHUNK_BYTES", 100)  # 2 rows of f32[12] per chunk
    with open_safetensors(tmp_path / "w.safetensors") as ckpt:
        for name, t in tensors.items():
            assert ckpt[name].shape == tuple(t.shape) and torch.equal(ckpt[name].load(), t)
        assert torch.equal(ckpt["f32"].narrow(0, 5, 9), tensors["f32"][5:14])
        assert torch.equal(ckpt["f32"].narrow(1, 3, 4), tensors["f32"][:, 3:7])
        dst = torch.empty(37, 12, dtype=torch.bfloat16)
        ckpt["f32"].copy_into(dst)
        assert torch.equal(dst, tensors["f32"].to(torch.bfloat16))


# The ranks leave with os._exit once every collective has answered: at a normal interpreter exit,
# gloo's and the TCP store's C++ threads are sometimes destroyed while still joinable and the rank
# aborts ("terminate called without an active exception", SIGABRT) after printing its results.
RANK_SCRIPT = """
import json, os, sys, torch
from services.executor.parallel.group import TensorParallelGroup
rank, world, port = (int(a) for a in sys.argv[1:4])
tp = TensorParallelGroup.connect(rank, world, "127.0.0.1", port, torch.device("cpu"), 60)
out = {}
for n in (0, 10, 4088, 4089, 100000):  # inline, at the header's edge, and longer
    payload = bytes(range(256)) * (n // 256) + bytes(n % 256) if rank == 0 else None
    got = tp.broadcast_bytes(payload)
    out[str(n)] = [len(got), got == bytes(range(256)) * (n // 256) + bytes(n % 256)]
sizes = [3, 2, 2][:world]
part = torch.arange(sizes[rank], dtype=torch.float32).repeat(2, 1) + 10 * rank
gathered = tp.gather_last_dim(part, sizes)
out["gather"] = None if gathered is None else gathered.tolist()
t = torch.full((2, 3), float(rank + 1), dtype=torch.bfloat16)
out["all_reduce"] = tp.all_reduce(t).float().tolist()
out["min"] = tp.min_over_ranks(100 - rank)
tp.min_over_ranks(0)  # every rank past its last collective before any leaves
print(json.dumps(out), flush=True)
os._exit(0)
"""


@pytest.mark.heavy
def test_group_collectives_between_processes():
    """Three ranks on gloo: rank 0's bytes reach every rank (one broadcast when they fit the
    header, two otherwise), rank 0 gathers ranges of unequal width, sums and minima agree."""
    world, port = 3, free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(world), str(port)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.splitlines()[-1]))
    for r, res in enumerate(results):
        for n in ("0", "10", "4088", "4089", "100000"):
            assert res[n] == [int(n), True], (r, n)
        assert res["all_reduce"] == [[6.0] * 3] * 2
        assert res["min"] == 98
        assert res["gather"] == ([[0.0, 1.0, 2.0, 10.0, 11.0, 20.0, 21.0]] * 2 if r == 0 else None)
