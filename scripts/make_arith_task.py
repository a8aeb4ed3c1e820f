"""Write the arithmetic task of the real-model demo: data/arith/{train,eval}.jsonl.

Questions "What is A + B? Answer with just the number." for A in 0..29 and B in 0..9, with
their answers; one in five (A, B) pairs, chosen by a fixed seed, is held out for evaluation,
so the eval reward measures unseen questions. Deterministic: rerunning rewrites the same files.
The default reward (`rl_async.algo.tasks:answer_match_reward`) compares the response's last number
with `answer`.

    python scripts/make_arith_task.py [OUT_DIR]
"""

import json
import random
import sys
from pathlib import Path


def rows():
    for a in range(30):
        for b in range(10):
            yield {"id": f"add-{a}-{b}",
                   "prompt": f"What is {a} + {b}? Answer with just the number.",
                   "answer": str(a + b)}


def main(out: Path) -> None:
    all_rows = list(rows())
    held = set(random.Random(0).sample(range(len(all_rows)), len(all_rows) // 5))
    out.mkdir(parents=True, exist_ok=True)
    for split, keep in (("train", lambda i: i not in held), ("eval", lambda i: i in held)):
        lines = [json.dumps(r) for i, r in enumerate(all_rows) if keep(i)]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"{out / split}.jsonl: {len(lines)} rows")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent.parent / "data" / "arith")
