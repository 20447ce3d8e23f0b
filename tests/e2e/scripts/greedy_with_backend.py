"""Greedy tokens of SmolLM2 through the executor's ModelRunner with a chosen attention
backend; prints JSON. Run in a fresh process for the Triton backend on the CPU
(TRITON_INTERPRET must precede triton's import); :func:`greedy` is the same run in-process.

    python tests/e2e/scripts/greedy_with_backend.py MODEL_DIR BACKEND NUM_TOKENS
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from services.executor.model_runner import ModelRunner  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.messages import NewRequestData, SamplingParams, StepPlan  # noqa: E402
from shared.model_source import load_model_info  # noqa: E402


def greedy(model_dir: str, backend: str, num_tokens: int) -> dict:
    """``{"backend": <the attention backend's class name>, "tokens": {request id: token ids}}``."""
    settings = Settings(model=model_dir, dtype="float32", attention_backend=backend, num_gpu_blocks_override=16)
    runner = ModelRunner(settings, load_model_info(settings))
    prompts = {"a": [1, 504, 3575, 282, 4649, 314], "b": [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198,
                                                         1, 520, 9531, 198, 504, 3575, 282]}
    params = SamplingParams(temperature=0, max_tokens=num_tokens)
    blocks = {"a": [7, 3], "b": [12, 0, 5]}  # shuffled physical blocks; "b" crosses a block boundary
    plan = StepPlan(step_id=1, group_id="g", num_scheduled_tokens={k: len(v) for k, v in prompts.items()},
                    new_requests=[NewRequestData(request_id=k, prompt_token_ids=v, sampling_params=params,
                                                 block_ids=blocks[k], num_computed_tokens=0)
                                  for k, v in prompts.items()])
    out = {k: [] for k in prompts}
    for step in range(num_tokens):
        for k, t in runner.execute(plan).sampled_token_ids.items():
            out[k].append(t)
        plan = StepPlan(step_id=step + 2, group_id="g", num_scheduled_tokens={k: 1 for k in prompts})
    return {"backend": type(runner.attn_backend).__name__, "tokens": out}


if __name__ == "__main__":
    print(json.dumps(greedy(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
