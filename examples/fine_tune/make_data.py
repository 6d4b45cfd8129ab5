"""Issue 30's fine-tuning scenario, its data: 3,000 prompt/completion examples (train.jsonl) and 200 more
(eval.jsonl) cut from the standard library's source, completions of a fine-tuning spread of lengths (gamma, mean
240 bytes) and about one prompt in eight longer than seq 1024 on its own (the issue's 371 of 3,000).

    python3 make_data.py   # in the directory that is to hold the two files
"""

import json
import random
import sysconfig
from pathlib import Path

FILES = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:120]
SOURCE = "\n".join(path.read_text(errors="replace") for path in FILES)


def example(rng: random.Random) -> dict[str, str]:
    prompt_length = rng.randint(1100, 1800) if rng.random() < 0.124 else rng.randint(20, 400)
    completion_length = max(8, int(rng.gammavariate(2.0, 120.0)))
    at = rng.randrange(0, len(SOURCE) - prompt_length - completion_length)
    return {"prompt": SOURCE[at:at + prompt_length],
            "completion": SOURCE[at + prompt_length:at + prompt_length + completion_length]}


def main() -> None:
    rng = random.Random(30)
    for name, count in (("train.jsonl", 3000), ("eval.jsonl", 200)):
        Path(name).write_text("".join(json.dumps(example(rng)) + "\n" for _ in range(count)))
        print(f"wrote {name}: {count} examples")


if __name__ == "__main__":
    main()
