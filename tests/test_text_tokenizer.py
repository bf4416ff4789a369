"""The router's tokenizer reads the model's files without transformers (so without torch) and
gives exactly the ids and chat prompts that transformers gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.errors import InvalidRequestError, ModelLoadError
from pdserve.text.tokenizer import RouterTokenizer, _token_bytes, load_router_tokenizer

TEXTS = ["Hello world", " leading space", "héllo wörld ✓ 日本", "a\nb\n\nc", ""]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def transformers_tokenizer(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def test_the_router_never_imports_torch_or_transformers(tiny_llama: Path) -> None:
    code = (
        "import sys; from pdserve.router.app import Router; from pdserve.text.tokenizer import load_router_tokenizer;"
        f"load_router_tokenizer({str(tiny_llama)!r}).encode('hi');"
        "import pdserve.serve, pdserve.cluster.local;"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ids_and_chat_template_match_transformers_on_a_hf_folder(tiny_llama: Path) -> None:
    ours, theirs = RouterTokenizer(tiny_llama), transformers_tokenizer(tiny_llama)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    ids = theirs.encode(TEXTS[2])
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    for add in (True, False):
        assert ours.apply_chat_template(CHAT, add) == theirs.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=add
        )
    assert ours.eos_token_id == theirs.eos_token_id


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_matches_transformers() -> None:
    from pdserve.modelfiles.gguf_file import find_builtin_gguf
    from pdserve.modelfiles.gguf_tokenizer import load_gguf_tokenizer

    ours, theirs = load_router_tokenizer("smollm2-135m"), load_gguf_tokenizer(find_builtin_gguf())
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
    assert ours.apply_chat_template(CHAT) == theirs.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )
    assert ours.eos_token_id == theirs.eos_token_id == 2


def test_add_bos_token_is_honoured_when_the_post_processor_does_not(tmp_path: Path, tiny_llama: Path) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    data = json.loads((tiny_llama / "tokenizer.json").read_text())
    data["post_processor"] = None  # as older tokenizer.json files: BOS was the Python class's job
    (folder / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((tiny_llama / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    ours = RouterTokenizer(folder)
    assert ours.encode("hi") == [ours.bos_token_id, *ours.encode("hi", add_special_tokens=False)]


def test_template_errors_are_the_requests_fault(tmp_path: Path, tiny_llama: Path) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((tiny_llama / "tokenizer.json").read_text())
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    )
    with pytest.raises(InvalidRequestError, match="first message must be from the user"):
        RouterTokenizer(folder).apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_missing_files_and_templates_say_what_is_wrong(tmp_path: Path, tiny_llama: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        RouterTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text((tiny_llama / "tokenizer.json").read_text())
    with pytest.raises(InvalidRequestError, match="no chat template"):
        RouterTokenizer(tmp_path).apply_chat_template(CHAT)


def test_token_pieces_carry_the_exact_bytes_of_split_characters() -> None:
    smollm2 = load_router_tokenizer("smollm2-135m")  # byte-level BPE
    text = "héllo 日本 😀"
    pieces = [smollm2.token_piece(t) for t in smollm2.encode(text, add_special_tokens=False)]
    assert b"".join(raw for _, raw in pieces).decode() == text
    assert any(piece == "\ufffd" or piece.endswith("\ufffd") for piece, _ in pieces)
    assert smollm2.token_piece(smollm2.encode("Hi", add_special_tokens=False)[0]) == ("Hi", b"Hi")
    # SentencePiece's byte fallback spells a lone byte <0xNN>; other spellings say nothing.
    assert _token_bytes("<0xE6>", byte_level=False) == b"\xe6"
    assert _token_bytes("\u2581hello", byte_level=False) is None


def test_token_pieces_of_sentencepiece_and_wrapped_byte_level_vocabularies(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spm = Tokenizer(models.WordLevel({"\u2581Hello": 0, "\u2581world": 1, "<unk>": 2}, unk_token="<unk>"))
    spm.pre_tokenizer = pre_tokenizers.Metaspace()
    spm.decoder = decoders.Metaspace()
    (tmp_path / "spm").mkdir()
    spm.save(str(tmp_path / "spm" / "tokenizer.json"))
    pieces = RouterTokenizer(tmp_path / "spm")
    # Decoded alone "▁world" reads "world"; its piece keeps the space, so pieces join to the text.
    assert pieces.token_piece(1) == (" world", b" world")
    assert pieces.decode([0, 1]) == "Hello world"

    smollm2 = json.loads((tokenizer_folder_of_smollm2() / "tokenizer.json").read_text())
    smollm2["decoder"] = {"type": "Sequence", "decoders": [smollm2["decoder"]]}
    (tmp_path / "wrapped").mkdir()
    (tmp_path / "wrapped" / "tokenizer.json").write_text(json.dumps(smollm2))
    wrapped = RouterTokenizer(tmp_path / "wrapped")
    ids = wrapped.encode("😀", add_special_tokens=False)
    assert len(ids) > 1 and b"".join(wrapped.token_piece(t)[1] for t in ids) == "😀".encode()


def tokenizer_folder_of_smollm2() -> Path:
    from pdserve.modelfiles.source import resolve_model
    from pdserve.text.tokenizer import tokenizer_folder

    return tokenizer_folder(resolve_model("smollm2-135m"))
