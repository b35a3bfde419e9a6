"""Token buckets: what the runner compiles and the scheduler fills."""

from jaxpaged.config import SchedulerConfig
from jaxpaged.config.buckets import pick_token_bucket, token_buckets
from jaxpaged.engine.arg_utils import EngineArgs


def test_powers_of_two_then_the_budget():
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 512, 1024]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(16) == [16]


def test_fine_buckets_add_halfway_steps_and_under_a_serving_budget_start_at_8_with_quarters_from_256():
    assert token_buckets(1024, fine=True) == [8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512,
                                              768, 1024]
    assert token_buckets(512, fine=True)[-5:] == [256, 320, 384, 448, 512]
    assert token_buckets(256, fine=True) == [16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert token_buckets(40, fine=True) == [16, 24, 32, 40]
    assert token_buckets(48, fine=True) == [16, 24, 32, 48]  # the budget is not repeated
    assert pick_token_bucket(token_buckets(1024, fine=True), 33) == 48
    assert pick_token_bucket(token_buckets(1024, fine=True), 5) == 8  # a few requests decoding
    assert pick_token_bucket(token_buckets(1024, fine=True), 300) == 320  # a served prompt with its decodes
    assert token_buckets(8192, fine=True)[-4:] == [1024, 2048, 4096, 8192]  # (chunked prefill off: few compiles)


def test_the_scheduler_and_runner_share_one_list_and_cpu_gets_fine_buckets(monkeypatch):
    monkeypatch.delenv("JAXPAGED_FINE_TOKEN_BUCKETS", raising=False)  # (the suite runs coarse: conftest.py)
    cfg = EngineArgs(max_num_batched_tokens=512).scheduler_config(model_max_len=4096)
    assert cfg.fine_token_buckets  # these tests run on CPU
    assert cfg.token_buckets() == token_buckets(512, fine=True)
    assert SchedulerConfig(max_num_batched_tokens=512).token_buckets() == token_buckets(512)


def test_the_environment_overrides_the_platform_choice(monkeypatch):
    monkeypatch.setenv("JAXPAGED_FINE_TOKEN_BUCKETS", "0")
    assert EngineArgs(max_num_batched_tokens=64).scheduler_config(model_max_len=4096).token_buckets() == [16, 32, 64]
    monkeypatch.setenv("JAXPAGED_FINE_TOKEN_BUCKETS", "1")
    assert EngineArgs(max_num_batched_tokens=64).scheduler_config(model_max_len=4096).token_buckets() == [
        16, 24, 32, 48, 64]
