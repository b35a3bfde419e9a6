"""`DraftBudget`: drafts are kept exactly when they raise the step's expected tokens per second."""

from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.spec_decode.budget import DraftBudget

BUCKETS = [16, 32, 64, 128]


def requests(count: int, drafts: int, accepted: int = 0, rejections: int = 0) -> list[Request]:
    out = []
    for i in range(count):
        r = Request(str(i), [1, 2, 3], SamplingParams(), seed=0, spec_token_ids=list(range(drafts)))
        r.num_accepted_tokens, r.num_draft_rejections = accepted, rejections
        out.append(r)
    return out


def budget(times: dict[int, float], verify_extra: float = 0.0, by_tokens: bool = False) -> DraftBudget:
    b = DraftBudget(BUCKETS, by_tokens=by_tokens)
    for bucket, t in times.items():
        b.observe_step(bucket, t, False)
        b.observe_step(bucket, t + verify_extra, True)
    return b


def test_untimed_budget_keeps_every_draft():
    reqs = requests(4, 3)
    assert DraftBudget(BUCKETS).trim(4, reqs, 128) == 12
    assert all(len(r.spec_token_ids) == 3 for r in reqs)


def test_flat_step_times_keep_every_draft():
    """Bound by reading weights: a bigger step costs the same, so any chance of acceptance pays."""
    reqs = requests(8, 4)
    assert budget({16: 0.01, 32: 0.01, 64: 0.01}).trim(8, reqs, 128) == 32
    assert all(len(r.spec_token_ids) == 4 for r in reqs)


def test_compute_bound_steps_keep_only_drafts_likely_enough():
    """A draft pays only if its chance of acceptance beats the tokens/s the bigger step displaces."""
    linear = {16: 0.016, 32: 0.032, 64: 0.064, 128: 0.128}
    good = requests(16, 4, accepted=200, rejections=2)  # almost always accepted
    assert budget(linear).trim(16, good, 128) == 0  # time linear in tokens: nothing short of certainty pays
    sublinear = {16: 0.016, 32: 0.021, 64: 0.04, 128: 0.08}  # 16 more tokens cost 30% more
    poor = requests(16, 4, accepted=1, rejections=30)  # rarely accepted
    assert budget(sublinear).trim(16, poor, 128) == 0
    assert all(len(r.spec_token_ids) == 0 for r in poor)
    good = requests(16, 4, accepted=200, rejections=2)
    # 64 tokens: 2.5x the time of 16 for ~3.9x the tokens; 128 would double the time again for < 2x
    assert budget(sublinear).trim(16, good, 128) == 48
    assert all(len(r.spec_token_ids) == 3 for r in good)


def test_drafts_fill_the_bucket_the_step_already_pays_for():
    """A step of 9 tokens runs in the 16-token bucket: 7 drafts ride along for free, the likeliest first (each
    request's first draft before anyone's second)."""
    reqs = requests(9, 4, accepted=10, rejections=10)
    kept = budget({16: 0.016, 32: 0.032, 64: 0.064}).trim(9, reqs, 128)
    assert kept == 7
    assert sorted(len(r.spec_token_ids) for r in reqs) == [0, 0] + [1] * 7


def test_verification_cost_is_counted():
    """Verifying drafts costs extra LM-head rows: when that is free, drafts in the bucket ride along; when it
    costs half a step more, drafts accepted half the time no longer pay."""
    reqs = requests(9, 1, accepted=10, rejections=10)
    assert budget({16: 0.016, 32: 0.032}).trim(9, reqs, 128) == 7
    reqs = requests(9, 1, accepted=10, rejections=10)
    assert budget({16: 0.016, 32: 0.032}, verify_extra=0.008).trim(9, reqs, 128) == 0


def test_a_marginal_gain_is_not_taken():
    """Drafts that promise under 10% more tokens per second are dropped (timings are noisy)."""
    reqs = requests(9, 1, accepted=1, rejections=20)  # 7 drafts, ~0.6 tokens expected: +7%
    assert budget({16: 0.016, 32: 0.032}).trim(9, reqs, 128) == 0


def test_acceptance_estimate_shrinks_to_the_global_rate():
    b = DraftBudget(BUCKETS)
    for _ in range(50):
        b.observe_verification(4, 4)  # the engine's drafts are usually accepted
    new, bad = requests(1, 4)[0], requests(1, 4, accepted=0, rejections=40)[0]
    assert b.acceptance(new) > 0.9
    assert b.acceptance(bad) < 0.1


def test_step_time_estimates_are_monotone_and_extrapolated():
    """Noisy timings cannot make a bigger step, or one with drafts, look cheaper; past the timed buckets the
    time grows linearly in tokens."""
    b = DraftBudget(BUCKETS)
    b.observe_step(16, 0.05, False)
    b.observe_step(32, 0.04, False)  # (noise)
    b.observe_step(16, 0.03, True)
    assert b.seconds(20, False) == 0.05
    assert b.seconds(10, True) == 0.05
    assert b.seconds(128, False) == 0.05 * 128 / 32


def test_where_steps_cost_their_tokens_each_draft_must_pay_for_itself():
    """Packed CPU weights skip padding rows: drafts filling a bucket are no longer free. Likely drafts (first
    positions of well-accepted requests) stay; the rarely accepted ones, which the bucket-filling rule keeps
    for free, are dropped."""
    times = {16: 0.016, 32: 0.020, 64: 0.040}  # (16 -> 32 tokens: a quarter of a ms a token)

    def mix():
        return requests(2, 4, accepted=90, rejections=10) + requests(2, 4, accepted=2, rejections=18)

    reqs = mix()
    assert budget(times).trim(16, reqs, 128) == 16  # bucket 32 filled: its time is paid anyway
    reqs = mix()
    assert budget(times, by_tokens=True).trim(16, reqs, 128) == 8
    assert [len(r.spec_token_ids) for r in reqs] == [4, 4, 0, 0]


def test_by_tokens_step_times_interpolate_and_observed_steps_count_for_their_full_bucket():
    b = budget({16: 0.016, 32: 0.032}, by_tokens=True)
    assert b.seconds(24, False) == 0.024 and b.seconds(32, False) == 0.032 and b.seconds(8, False) == 0.016
    b.observe_step(32, 0.024, False, num_tokens=24)  # three quarters of the bucket, at its predicted time
    assert abs(b.step_seconds[False][32] - 0.032) < 1e-12
    plain = budget({16: 0.016, 32: 0.032})
    plain.observe_step(32, 0.024, False, num_tokens=24)  # (a bucket's time, whatever fills it)
    assert plain.seconds(24, False) < 0.032
