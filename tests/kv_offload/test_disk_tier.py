"""The disk tier: files round-trip; a corrupt, truncated, foreign or colliding file is skipped with a warning
and never read as KV; an unwritable folder turns the tier off; the byte budget evicts the oldest files; a new
tier over the same folder (a restarted engine) finds the old files."""

from __future__ import annotations

import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kv_offload import DiskTier

SHAPE = (2, 2, 4, 1, 3)


def tier(root, identity="model-a", capacity=1 << 30, dtype=np.float32) -> DiskTier:
    return DiskTier(str(root), identity, capacity, block_size=4, block_shape=SHAPE, dtype=dtype)


def block(seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_round_trip(tmp_path, dtype):
    t = tier(tmp_path, dtype=np.dtype(dtype))
    kv = block(0, dtype)
    t.write(7, (1, 2, 3, 4), kv)
    t.flush()
    got = t.read(7, (1, 2, 3, 4))
    assert got.dtype == np.dtype(dtype) and np.array_equal(got.view(np.uint8), kv.view(np.uint8))
    assert t.read(8, (1, 2, 3, 4)) is None  # never written
    assert not [f for f in os.listdir(t.dir) if f.endswith(".tmp")]  # written to a temporary name, then renamed


def test_restart_finds_earlier_files(tmp_path):
    t = tier(tmp_path)
    for h in range(3):
        t.write(h, (h,), block(h))
    t.close()
    again = tier(tmp_path)
    assert len(again.index) == 3
    assert np.array_equal(again.read(2, (2,)), block(2))


def test_another_model_never_sees_the_files(tmp_path):
    t = tier(tmp_path, "model-a")
    t.write(1, (1,), block(1))
    t.flush()
    assert tier(tmp_path, "model-b").read(1, (1,)) is None


def corrupt(path: str, how: str) -> None:
    data = bytearray(open(path, "rb").read())
    if how == "flip":
        data[-5] ^= 0xFF  # inside the KV bytes: the checksum catches it
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "garbage":
        data = bytearray(b"not a safetensors file at all")
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "garbage"])
def test_corrupt_files_are_skipped_and_removed(tmp_path, caplog, how):
    t = tier(tmp_path)
    t.write(5, (9, 9), block(5))
    t.flush()
    corrupt(t.path(5), how)
    with caplog.at_level(logging.WARNING):
        assert t.read(5, (9, 9)) is None
    assert "skipping" in caplog.text and not os.path.exists(t.path(5)) and 5 not in t


def test_a_file_with_other_metadata_is_skipped(tmp_path, caplog):
    """A file whose header names another block size (same folder, e.g. copied by hand) is not read as KV."""
    other = DiskTier(str(tmp_path), "model-a", 1 << 30, block_size=8, block_shape=SHAPE, dtype=np.float32)
    other.write(3, (1,), block(3))
    other.flush()
    with caplog.at_level(logging.WARNING):
        assert tier(tmp_path).read(3, (1,)) is None
    assert "block_size" in caplog.text


def test_a_hash_collision_is_a_miss(tmp_path):
    t = tier(tmp_path)
    t.write(4, (1, 2), block(4))
    t.flush()
    assert t.read(4, (1, 3)) is None


def test_half_written_files_are_invisible(tmp_path):
    """A writer's temporary file (another engine mid-write) is neither indexed nor read."""
    t = tier(tmp_path)
    open(t.path(6) + ".123.0.tmp", "wb").write(b"partial")
    assert t.read(6, (1,)) is None and 6 not in tier(tmp_path).index


def test_unwritable_folder_turns_the_tier_off(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the folder should be
    with caplog.at_level(logging.WARNING):
        t = tier(blocker)
        t.write(1, (1,), block(1))
        t.flush()
    assert not t.enabled and "KV disk tier off" in caplog.text and t.read(1, (1,)) is None


def test_failed_write_turns_the_tier_off(tmp_path, caplog, monkeypatch):
    t = tier(tmp_path)

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("jaxpaged.kv_offload.disk_tier.save_file", full)
    with caplog.at_level(logging.WARNING):
        t.write(1, (1,), block(1))
        t.flush()
    assert not t.enabled and "No space left" in caplog.text
    t.write(2, (2,), block(2))  # further writes are dropped quietly
    t.flush()
    assert not os.listdir(t.dir)


def test_byte_budget_evicts_the_least_recently_used(tmp_path):
    t = tier(tmp_path)
    t.write(0, (0,), block(0))
    t.flush()
    size = os.path.getsize(t.path(0))
    small = tier(tmp_path, capacity=2 * size + size // 2)  # room for two
    small.write(1, (1,), block(1))
    small.flush()
    assert small.read(0, (0,)) is not None  # 0 is now more recent than 1
    small.write(2, (2,), block(2))
    small.flush()
    assert sorted(small.index) == [0, 2] and not os.path.exists(small.path(1))


def test_a_block_another_engine_wrote_later_is_found(tmp_path):
    """Two engines sharing a folder: a file written after this one indexed the folder is still read."""
    reader, writer = tier(tmp_path), tier(tmp_path)
    writer.write(9, (4, 2), block(9))
    writer.flush()
    assert 9 not in reader.index
    assert np.array_equal(reader.read(9, (4, 2)), block(9)) and 9 in reader.index
