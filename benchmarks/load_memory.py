"""Peak memory while loading a checkpoint into our model, against the size of its weights.

    .venv/bin/python benchmarks/load_memory.py [MODEL_DIR] [--dtype bfloat16|float32]

Builds the model class for ``MODEL_DIR`` (default: the bundled SmolLM2, converted) with its
parameters allocated in the serving dtype, loads the safetensors checkpoint into them
(``load_weights``: read in chunks, cast on copy) and samples this process's RSS every 5 ms.
Prints the weights' bytes in the serving dtype, the RSS growth at its peak while loading
(the parameters plus what loading holds besides) and its ratio to the weights (goal: at
most 1.3x), then the growth once the kernels' weight forms are derived.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import AutoConfig  # noqa: E402

from services.executor.models import get_model_class  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.model_source import load_model_info  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    path = load_model_info(Settings(model=args.model)).path
    dtype = getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(path)
    proc = psutil.Process()
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    base = proc.memory_info().rss
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    model = get_model_class(config)(config, dtype, torch.device("cpu"))
    use_kernels = model.use_kernels
    loaded: dict[str, float] = {}

    def snapshot_then_use_kernels(kernels) -> None:  # load_weights ends by deriving the kernels' forms
        loaded.update(peak=peak[0], seconds=time.perf_counter() - t0)
        use_kernels(kernels)

    model.use_kernels = snapshot_then_use_kernels
    model.load_weights(path)
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    grown, after = loaded["peak"] - base, peak[0] - base
    on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"model {path.name}, serving dtype {args.dtype}, checkpoint on disk {on_disk / 2**20:.1f} MiB")
    print(f"weights in the serving dtype: {weights / 2**20:.1f} MiB")
    print(f"RSS growth at its peak while loading: {grown / 2**20:.1f} MiB = {grown / weights:.2f}x the weights "
          f"(loaded in {loaded['seconds']:.2f} s)")
    print(f"then with the kernels' weight forms (oneDNN prepacked copies, panels): {after / 2**20:.1f} MiB = "
          f"{after / weights:.2f}x ({seconds:.2f} s in all)")


if __name__ == "__main__":
    main()
