"""`inference.lora.files`: an adapter directory read without waiting on anything a client names."""

from __future__ import annotations

import os
import struct

import pytest

from inference.errors import LoRALoadError
from inference.lora.files import MAX_HEADER_BYTES, read_adapter_files


def adapter_dir(root, weights: bytes):
    root.mkdir()
    (root / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (root / "adapter_model.safetensors").write_bytes(weights)
    return root


def test_a_safetensors_header_past_the_bound_is_refused_before_it_is_parsed(tmp_path):
    huge = adapter_dir(tmp_path / "huge", struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{" * 64)
    with pytest.raises(LoRALoadError, match="not a safetensors file"):
        read_adapter_files(str(huge))
    cut = adapter_dir(tmp_path / "cut", struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(LoRALoadError, match="cut short"):
        read_adapter_files(str(cut))
    fine = adapter_dir(tmp_path / "fine", struct.pack("<Q", 2) + b"{}")
    assert read_adapter_files(str(fine))[0] == b'{"peft_type": "LORA"}'


def test_only_regular_files_are_read_and_the_opened_directory_is_checked(tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    (fifo / "adapter_config.json").write_text("{}")
    os.mkfifo(fifo / "adapter_model.safetensors")
    with pytest.raises(LoRALoadError, match="not a regular file"):
        read_adapter_files(str(fifo))
    seen = []
    fine = adapter_dir(tmp_path / "fine", struct.pack("<Q", 2) + b"{}")
    link = tmp_path / "link"
    link.symlink_to(fine)
    read_adapter_files(str(link), seen.append)
    assert seen == [str(fine)]  # the directory as opened, not as named
    with pytest.raises(LoRALoadError, match="does not exist"):
        read_adapter_files(str(tmp_path / "absent"))


def test_a_library_panic_reaches_the_client_without_its_backtrace():
    from inference.sampling.grammar import _first_line

    panic = ("thread '<unnamed>' panicked at src/json/compiler.rs:12:5:\nindex out of bounds\n"
             "stack backtrace:\n   0: 0x7f00deadbeef - rust_begin_unwind\n   1: 0x7f00 - core::panicking")
    assert _first_line(panic) == "thread '<unnamed>' panicked at src/json/compiler.rs:12:5:\nindex out of bounds"
    assert _first_line("plain error\n  at line 1") == "plain error\n  at line 1"
