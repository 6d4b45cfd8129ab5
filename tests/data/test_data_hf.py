"""Hugging Face data sources: saved datasets, parquet/csv/jsonl files, fields, tokenizers and the tokenisation cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

from cadence.data import BYTE_EOS_ID, IGNORE_INDEX, read_jsonl  # noqa: E402
from cadence.data.hf import ByteTokenizer, HFTokenizer, as_tokenizer, is_hf_data, load_hf_data  # noqa: E402
from cadence.data.store import STORE_VERSION  # noqa: E402
from cadence.errors import UsageError  # noqa: E402

TEXTS = ["the step chain", "micro batches and windows", "clip the norm once", "scale then step", "zero the grads"]
PAIRS = {
    "prompt": ["Q: step?", "Q: clip?", "Q: scale?", "", "Q: sync?"],
    "completion": ["A: once", "A: after unscale", "A: fp16 only", "A: x", "A: last"],
}


def load(spec: Path | str, **kwargs):
    options = {"seq_len": 64, "tokenizer": None, "val_fraction": 0.0, "cache_dir": None, **kwargs}
    return load_hf_data(spec, **options)


def as_lists(dataset) -> list[tuple[list[int], list[int]]]:
    return [(example.input_ids.tolist(), example.labels.tolist()) for example in dataset]


def problem(excinfo: pytest.ExceptionInfo[UsageError]) -> tuple[str, str]:
    return excinfo.value.problems[0].where, excinfo.value.problems[0].message


class CountingTokenizer(ByteTokenizer):
    """Bytes, counting how often it is asked to tokenise (to see a cache hit do no tokenising at all)."""

    calls: list[int]

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "calls", [])

    def encode_batch(self, texts, max_length=None):
        self.calls.append(len(texts))
        return super().encode_batch(texts, max_length)


def hf_tokenizer(llama_style: bool = False):
    """A byte-level BPE trained in memory on a few sentences, with an EOS token (nothing downloaded).

    ``llama_style``: the tokenizer also adds a BOS token in front of every text by itself, as Llama's does.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(TEXTS * 5, trainer)
    if not llama_style:
        return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", bos_token="<s>")
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", bos_token="<s>")


# ------------------------------------------------------------------------------------------------ sources
def test_saved_dataset_with_text(tmp_path: Path) -> None:
    datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(5))}).save_to_disk(tmp_path / "saved")
    splits = load(f"hf:{tmp_path / 'saved'}", val_fraction=0.2)
    assert len(splits.train) == 4 and len(splits.val) == 1 and splits.truncated == 0
    first = TEXTS[0].encode()
    assert as_lists(splits.train)[0] == (list(first[:-1]), list(first[1:]))  # every byte after the first: a target
    assert "saved dataset" in splits.description and "4 train / 1 validation" in splits.description


def test_saved_dataset_with_prompt_and_completion(tmp_path: Path) -> None:
    datasets.Dataset.from_dict(PAIRS).save_to_disk(tmp_path / "pairs")
    splits = load(f"hf:{tmp_path / 'pairs'}")
    assert len(splits.train) == 5
    for example, prompt, completion in zip(splits.train, PAIRS["prompt"], PAIRS["completion"]):
        full = (prompt + completion).encode() + bytes([BYTE_EOS_ID])  # a completion ends with the end of sequence
        assert example.input_ids.tolist() == list(full[:-1]) and example.labels[-1] == BYTE_EOS_ID
        # loss on the completion and its end only (with an empty prompt nothing predicts the completion's first byte)
        assert example.num_targets == len(completion) + 1 - (not prompt)
        masked = max(len(prompt.encode()) - 1, 0)
        assert (example.labels[:masked] == IGNORE_INDEX).all()


def test_saved_dataset_dict_uses_its_validation_split(tmp_path: Path) -> None:
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": TEXTS}),
        "validation": datasets.Dataset.from_dict({"text": ["held out one", "held out two"]}),
    }).save_to_disk(tmp_path / "dict")
    splits = load(f"hf:{tmp_path / 'dict'}", val_fraction=0.1)
    assert len(splits.train) == 5 and len(splits.val) == 2
    assert bytes(splits.val[0].input_ids.tolist()) == b"held out on"
    assert load(f"hf:{tmp_path / 'dict'}", val_fraction=0.0).val is None


def write(tmp_path: Path, fmt: str) -> Path:
    dataset = datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(5))})
    path = tmp_path / f"data.{fmt}"
    {"parquet": dataset.to_parquet, "csv": dataset.to_csv, "jsonl": dataset.to_json}[fmt](str(path))
    return path


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_files_load_and_agree(tmp_path: Path, fmt: str) -> None:
    path = write(tmp_path, fmt)
    assert is_hf_data(path) or fmt == "jsonl"  # .jsonl stays with the built-in reader unless a tokenizer needs this
    splits = load(path, cache_dir=tmp_path / "cache")
    assert as_lists(splits.train) == [(list(t.encode()[:-1]), list(t.encode()[1:])) for t in TEXTS]
    # datasets' Arrow copies live in a temporary folder while tokenising: the token store is what is kept.
    assert not (Path.home() / ".cache" / "huggingface").exists() and len(stores(tmp_path / "cache")) == 1


def test_jsonl_bytes_match_the_builtin_reader(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": p, "completion": c * 5} for p, c in zip(PAIRS["prompt"], PAIRS["completion"])]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    for too_long in ("skip", "truncate"):  # --too-long acts the same on both readers
        builtin, longer = read_jsonl(path, 24, too_long=too_long)
        splits = load(path, seq_len=24, too_long=too_long)
        assert as_lists(splits.train) == as_lists(builtin) and splits.long_examples.too_long == longer > 0


def test_truncation_and_skipped_rows(tmp_path: Path) -> None:
    datasets.Dataset.from_dict({"text": ["x" * 100, "", None, "a", "ok text"]}).save_to_disk(tmp_path / "s")
    splits = load(f"hf:{tmp_path / 's'}", seq_len=10, too_long="truncate")
    assert [len(e.input_ids) for e in splits.train] == [10, 6]  # cut to seq_len; "", None and "a" skipped
    assert splits.truncated == 1 and "3 rows skipped" in splits.description
    skipped = load(f"hf:{tmp_path / 's'}", seq_len=10)
    assert [len(e.input_ids) for e in skipped.train] == [6] and "1 longer than --seq-len skipped" in skipped.description


# ------------------------------------------------------------------------------------------------ errors
def test_missing_text_field_names_it_and_the_fields_that_exist(tmp_path: Path) -> None:
    path = write(tmp_path, "parquet")
    with pytest.raises(UsageError) as excinfo:
        load(path, text_field="body")
    where, message = problem(excinfo)
    assert where == "--text-field" and "'body'" in message and "'text'" in message and "'n'" in message


def test_missing_completion_field(tmp_path: Path) -> None:
    datasets.Dataset.from_dict(PAIRS).save_to_disk(tmp_path / "pairs")
    with pytest.raises(UsageError) as excinfo:
        load(f"hf:{tmp_path / 'pairs'}", completion_field="answer")
    where, message = problem(excinfo)
    assert where == "--completion-field" and "'answer'" in message and "'prompt', 'completion'" in message
    with pytest.raises(UsageError) as excinfo:
        load(f"hf:{tmp_path / 'pairs'}", prompt_field="question")
    assert problem(excinfo)[0] == "--prompt-field"


def test_non_text_field_and_empty_and_unknown_sources(tmp_path: Path) -> None:
    path = write(tmp_path, "parquet")
    with pytest.raises(UsageError) as excinfo:
        load(path, text_field="n")
    assert problem(excinfo)[0] == "--text-field" and "int64" in problem(excinfo)[1]
    datasets.Dataset.from_dict({"text": ["", None, "x"]}).save_to_disk(tmp_path / "blank")
    with pytest.raises(UsageError) as excinfo:
        load(f"hf:{tmp_path / 'blank'}")
    assert problem(excinfo) == (
        "--data", f"saved dataset {tmp_path / 'blank'} has no examples (all 3 rows were empty or had no target)"
    )
    for name, content in [("header.csv", "text\n"), ("empty.jsonl", "")]:
        (tmp_path / name).write_text(content)
        with pytest.raises(UsageError) as excinfo:
            load(tmp_path / name)
        # datasets' "no rows" for the CSV; cadence's own JSONL route for the .jsonl file, whatever the model
        assert problem(excinfo)[0] == "--data" and ("no rows" in problem(excinfo)[1] or "has no examples (it is "
                                                    "empty or only blank lines)" in problem(excinfo)[1])
    (tmp_path / "notes.md").write_text("hi")
    for spec in [tmp_path / "notes.md", tmp_path / "missing.parquet", f"hf:{tmp_path / 'notes.md'}", f"hf:{tmp_path}"]:
        with pytest.raises(UsageError) as excinfo:
            load(spec)
        assert problem(excinfo)[0] == "--data"
    with pytest.raises(UsageError) as excinfo:
        load(path, val_fraction=1.0)
    assert problem(excinfo)[0] == "--val-fraction"


# ------------------------------------------------------------------------------------------------ tokenizers
def test_transformers_tokenizer_appends_eos_as_a_target(tmp_path: Path) -> None:
    tokenizer = hf_tokenizer()
    eos = tokenizer.eos_token_id
    datasets.Dataset.from_dict(PAIRS).save_to_disk(tmp_path / "pairs")
    splits = load(f"hf:{tmp_path / 'pairs'}", tokenizer=tokenizer)
    example = splits.train[0]
    prompt = tokenizer.encode(PAIRS["prompt"][0], add_special_tokens=False)
    completion = tokenizer.encode(PAIRS["completion"][0], add_special_tokens=False)
    assert example.input_ids.tolist() == prompt + completion  # the last input predicts EOS
    assert example.labels.tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + completion + [eos]
    wrapped = as_tokenizer(tokenizer)
    assert isinstance(wrapped, HFTokenizer) and wrapped.eos_id == eos and wrapped.bos_id is None
    assert isinstance(as_tokenizer(None), ByteTokenizer) and as_tokenizer(wrapped) is wrapped


def test_bos_is_prepended_only_when_the_tokenizer_adds_it_itself(tmp_path: Path) -> None:
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(tmp_path / "saved")
    plain, llama = as_tokenizer(hf_tokenizer()), as_tokenizer(hf_tokenizer(llama_style=True))
    assert plain.bos_id is None and llama.bos_id == llama.hf_tokenizer.bos_token_id
    assert plain.identity != llama.identity  # the cache must not mix them up
    example = load(f"hf:{tmp_path / 'saved'}", tokenizer=llama.hf_tokenizer).train[0]
    ids = llama.encode(TEXTS[0])
    assert example.input_ids.tolist() == [llama.bos_id] + ids
    assert example.labels.tolist() == ids + [llama.eos_id]  # the first text token is predicted from BOS


# ------------------------------------------------------------------------------------------------ cache
def stores(cache: Path) -> list[Path]:
    return [p for p in (cache / "stores").iterdir() if not p.name.startswith(".")]


def test_tokenisation_cache_hits_the_second_time(tmp_path: Path) -> None:
    path = write(tmp_path, "csv")
    cache = tmp_path / "cache"
    first_tok, second_tok = CountingTokenizer(), CountingTokenizer()
    first = load(path, tokenizer=first_tok, cache_dir=cache, val_fraction=0.2)
    assert first_tok.calls and len(stores(cache)) == 1
    second = load(path, tokenizer=second_tok, cache_dir=cache, val_fraction=0.2)
    assert second_tok.calls == [] and "from the cache" in second.description
    assert as_lists(second.train) == as_lists(first.train) and as_lists(second.val) == as_lists(first.val)
    # Another --seq-len reads the same store: examples are cut when read, not when stored.
    third_tok = CountingTokenizer()
    short = load(path, tokenizer=third_tok, cache_dir=cache, seq_len=8, too_long="truncate")
    assert third_tok.calls == [] and max(len(e.input_ids) for e in short.train) == 8 and short.truncated > 0
    # Other field names, or other file content, miss.
    fields_tok = CountingTokenizer()
    load(path, tokenizer=fields_tok, cache_dir=cache, prompt_field="question")
    assert fields_tok.calls
    path.write_text(path.read_text().replace("step", "STEP"))
    os.utime(path, ns=(1, 1))  # a rewrite within the same second must still change the identity (size or times)
    fourth_tok = CountingTokenizer()
    changed = load(path, tokenizer=fourth_tok, cache_dir=cache, val_fraction=0.2)
    assert fourth_tok.calls and as_lists(changed.train) != as_lists(first.train)
    assert changed.fingerprint != first.fingerprint
    assert len(stores(cache)) == 3


def test_cache_keys_the_tokenizer(tmp_path: Path) -> None:
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(tmp_path / "saved")
    cache = tmp_path / "cache"
    as_bytes = load(f"hf:{tmp_path / 'saved'}", cache_dir=cache)
    as_bpe = load(f"hf:{tmp_path / 'saved'}", cache_dir=cache, tokenizer=hf_tokenizer())
    assert "from the cache" not in as_bpe.description
    assert as_lists(as_bpe.train) != as_lists(as_bytes.train)
    again = load(f"hf:{tmp_path / 'saved'}", cache_dir=cache, tokenizer=hf_tokenizer())
    assert "from the cache" in again.description and as_lists(again.train) == as_lists(as_bpe.train)


def test_damaged_cache_is_rebuilt(tmp_path: Path) -> None:
    path = write(tmp_path, "parquet")
    cache = tmp_path / "cache"
    first = as_lists(load(path, cache_dir=cache).train)  # read before the damage below (it maps the same file)
    (store,) = stores(cache)
    tokens = store / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-3])  # shorter than store.json says: never trusted
    tok = CountingTokenizer()
    again = load(path, cache_dir=cache, tokenizer=tok)
    assert tok.calls and as_lists(again.train) == first
    assert json.loads((store / "store.json").read_text())["version"] == STORE_VERSION


# Each case is a process of its own (the datasets library prints to the real stderr): one in make test, the others
# in make test-slow.
@pytest.mark.parametrize("name, content, says", [
    pytest.param("ragged.csv", b"text,other\nhello,1\nworld,2,3,4\n", "Expected 2 fields in line 3, saw 4",
                 marks=pytest.mark.slow),
    pytest.param("binary.json", b"\x00\x01\x02binary", "JSON parse error", marks=pytest.mark.slow),
    ("corrupt.parquet", b"not parquet\n", "Parquet magic bytes not found"),
])
def test_a_malformed_datasets_file_is_one_line_with_the_real_cause(tmp_path, name, content, says):
    """Issue 29 item 15: the datasets library printed its own line first, and cadence's then said only "An error
    occurred while generating the dataset"."""
    import subprocess
    import sys

    path = tmp_path / name
    path.write_bytes(content)
    cadence = str(Path(sys.executable).with_name("cadence"))
    result = subprocess.run([cadence, "train", "--data", str(path), "--max-steps", "1", "--data-cache",
                             str(tmp_path / "cache"), "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("cadence: error: --data: could not read ") and says in lines[0], \
        result.stderr
    assert "<class" not in lines[0]


# ------------------------------------------------------------------------------------------------ one JSONL route
def test_a_jsonl_file_reads_by_the_same_rules_whatever_the_model(tmp_path: Path) -> None:
    """Issue 37: a .jsonl file was read by cadence's byte reader for a built-in model and by datasets for a model
    with a tokenizer, with different rules (a row holding a text and a prompt: refused by one, trained on the
    completion by the other; the field flags ignored by one). Now one route: the same rows become the same examples
    (up to the tokenizer's ids), bad lines are named file:line for both, and the field flags apply to both."""
    path = tmp_path / "rows.jsonl"
    rows = [{"body": "a plain text row", "id": 1},
            {"q": "question?", "a": " answer", "body": "ignored: the pair wins"},
            {"q": "", "a": "completion alone"}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    fields = {"text_field": "body", "prompt_field": "q", "completion_field": "a"}
    byte_examples = [e for e in load(path, seq_len=64, **fields).train]
    tokenizer = hf_tokenizer()
    token_examples = [e for e in load(path, seq_len=64, tokenizer=tokenizer, **fields).train]
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    # Bytes: a text without an end of sequence, a completion with BYTE_EOS_ID; the tokenizer: both end with its EOS.
    assert byte_examples[0].input_ids.tolist() == list(b"a plain text row")[:-1]
    assert token_examples[0].labels.tolist() == ids("a plain text row")[1:] + [eos]
    question, answer = ids("question?"), ids(" answer")
    assert token_examples[1].labels.tolist() == [IGNORE_INDEX] * (len(question) - 1) + answer + [eos]
    assert byte_examples[1].labels.tolist() == [IGNORE_INDEX] * (len(b"question?") - 1) + list(b" answer") + [
        BYTE_EOS_ID]
    assert [e.num_targets for e in byte_examples][2] == len(b"completion alone")  # the first byte has no input
    # The same bad lines, named the same way, for both models.
    path.write_text(path.read_text() + json.dumps({"q": "no answer"}) + "\n" + json.dumps({"body": 3}) + "\n")
    for tok in (None, tokenizer):
        with pytest.raises(UsageError) as excinfo:
            load(path, seq_len=64, tokenizer=tok, **fields)
        assert [(p.where, p.message.split(";")[0]) for p in excinfo.value.problems] == [
            (f"{path}:4", 'has no "a"'), (f"{path}:5", '"body" must be a string, got int')]
