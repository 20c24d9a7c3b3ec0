"""The structured step with the constrained rows' masks started before the step is built ("early",
the engine's way) or where the sampler needs them ("late", as before): one process per variant,
`python docs/bench/h200/dec02/structured_ab.py --model DIR --variant early|late --out F.json`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import worker  # noqa: F401  (before MLX loads: the worker's CUDA launch setting, as the worker runs)
from mlxq.bench.config import BenchConfig
from mlxq.bench.structured import structured, summary_line


def begin_late() -> None:
    from worker.engines import step_sampling

    sampler = step_sampling.StepSampler
    begin, sample = sampler.begin, sampler.sample

    def sample_beginning_now(self, logits, inputs, occupied, slot_count, rows=None):  # type: ignore[no-untyped-def]
        begin(self, occupied, inputs, rows)
        return sample(self, logits, inputs, occupied, slot_count, rows)

    sampler.begin = lambda self, occupied, inputs, rows=None: None  # type: ignore[method-assign]
    sampler.sample = sample_beginning_now  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--variant", choices=("early", "late"), required=True)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.variant == "late":
        begin_late()
    cfg = BenchConfig(out=args.out, max_num_seqs=args.rows, prompt_tokens=64, new_tokens=64, repeats=args.repeats)
    result = structured(cfg, args.model, "compiled")
    result["variant"] = args.variant
    args.out.write_text(json.dumps(result, indent=1))
    print(args.variant, summary_line(result), result["check"], flush=True)


if __name__ == "__main__":
    main()
