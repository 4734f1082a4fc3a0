"""The run's one seed policy (pyrl.seeding): no two coordinates of any purpose share a seed, none is within a
request's sample offsets of another, and a seed depends on the coordinates' names and values only."""

import numpy as np
import pytest

from pyrl.seeding import PURPOSES, SEED_BITS, derive_seed

SAMPLES_PER_PROMPT = 64  # vLLM seeds a request's j-th sample with its seed + j


def every_site_seed(base: int) -> dict[int, tuple]:
    """Each site's seeds over coordinates well past a long run's (2,000 steps x 8 refills, 256 ranks, 256
    trajectories x 16 requests, 4,096 prompts in a call), by seed."""
    coordinates = ([("rollout", {"step": s, "refill": r}) for s in range(2000) for r in range(8)]
                   + [(purpose, {"rank": r}) for purpose in ("rank", "dropout") for r in range(256)]
                   + [("trajectory", {"index": i, "call": c}) for i in range(256) for c in range(16)]
                   + [("prompt", {"prompt": p}) for p in range(4096)])
    seeds = {}
    for purpose, coords in coordinates:
        seed = derive_seed(base, purpose, **coords)
        assert seed not in seeds, f"{purpose} {coords} has the seed of {seeds[seed]}"
        seeds[seed] = (purpose, coords)
    return seeds


@pytest.mark.parametrize("base", [0, 1, 42, 2**40 + 3])
def test_no_two_coordinates_share_a_seed(base):
    seeds = np.array(sorted(every_site_seed(base)), dtype=np.uint64)
    assert len(seeds) == 2000 * 8 + 2 * 256 + 256 * 16 + 4096
    assert int(seeds.max()) < 2**SEED_BITS and int(seeds.min()) >= 0
    # a prompt's samples use seed .. seed + n - 1: no other stream starts in that range
    assert int(np.diff(seeds).min()) >= SAMPLES_PER_PROMPT


def test_engine_seeds_fit_32_bits_and_differ_by_rank():
    """vLLM's engine seeds numpy with its seed, which takes 32 bits."""
    seeds = [derive_seed(0, "engine", bits=32, rank=r) for r in range(256)]
    assert len(set(seeds)) == 256 and max(seeds) < 2**32
    assert derive_seed(0, "engine", bits=32, rank=3) == derive_seed(0, "engine", rank=3) >> (SEED_BITS - 32)


def test_bases_give_unrelated_streams():
    """Neighbouring base seeds (rollout.seed=0 and =1) share no seed at any coordinate: no offset of a base is
    another base's stream."""
    assert not set(every_site_seed(0)) & set(every_site_seed(1))


def test_a_seed_depends_on_names_and_values_only():
    assert derive_seed(7, "rollout", step=3, refill=1) == derive_seed(7, "rollout", refill=1, step=3)
    assert derive_seed(7, "rollout", step=1, refill=0) != derive_seed(7, "rollout", step=0, refill=1)
    assert derive_seed(7, "rank", rank=2) != derive_seed(7, "engine", rank=2)
    assert (derive_seed(np.int64(7), "trajectory", index=np.int32(2), call=1)
            == derive_seed(7, "trajectory", index=2, call=1))
    # stable across machines and releases (a change here changes every sampled run: make it on purpose)
    assert derive_seed(0, "rollout", step=0, refill=0) == derive_seed(0, "rollout", refill=0, step=0)
    words = np.random.SeedSequence(0, spawn_key=[1956693391, 1929225468, 0, 1136262716, 0])  # CRC-32s of the names
    expected = (int(words.generate_state(2, dtype=np.uint32)[0]) << 32
                | int(words.generate_state(2, dtype=np.uint32)[1])) >> (64 - SEED_BITS)
    assert derive_seed(0, "rollout", step=0, refill=0) == expected


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown purpose 'rollouts'"):
        derive_seed(0, "rollouts", step=1)
    with pytest.raises(ValueError, match="coordinate step=-1"):
        derive_seed(0, "rollout", step=-1)
    with pytest.raises(ValueError, match="coordinate rank=True"):
        derive_seed(0, "rank", rank=True)
    with pytest.raises(ValueError, match="base seed must be an integer"):
        derive_seed(1.5, "rank", rank=0)
    with pytest.raises(ValueError, match="bits=0, expected 1 to 64"):
        derive_seed(1, "rank", bits=0, rank=0)
    assert set(PURPOSES) == {"rollout", "rank", "engine", "dropout", "trajectory", "prompt"}
