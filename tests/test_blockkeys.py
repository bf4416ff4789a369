"""Block keys of the prefix cache: a hash chain over token ids, the same in every process."""

import subprocess
import sys

from pdserve.blockkeys import block_key, prompt_keys


def test_block_keys_chain_every_token_before_them_and_the_salt() -> None:
    keys = prompt_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, b"s")
    assert len(keys) == 2 and keys == prompt_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, b"s")  # deterministic
    assert prompt_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, b"s", limit=7) == keys[:1]
    # The same four tokens after a different first block, or with another salt, are another block.
    assert prompt_keys([9, 9, 9, 9, 5, 6, 7, 8], 4, b"s")[1] != keys[1]
    assert prompt_keys([1, 2, 3, 4], 4, b"other model")[0] != keys[0]
    assert block_key(b"", [1, 2, 3, 4], b"s") == keys[0]


def test_keys_are_the_same_in_another_process() -> None:
    code = (
        "from pdserve.blockkeys import prompt_keys; print(prompt_keys(list(range(70)), 16, b'm').__repr__())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == repr(prompt_keys(list(range(70)), 16, b"m"))
