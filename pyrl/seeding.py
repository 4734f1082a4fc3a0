"""One seed policy for the run: every seeded random stream is

    seed = derive_seed(base, purpose, **coordinates)

the first 62 bits of `numpy.random.SeedSequence(entropy=base, spawn_key=(purpose, name_1, value_1, ...))`, with the
coordinates in name order and names hashed by CRC-32. Distinct (purpose, coordinates) give independent seeds (a
hash, not an offset: no stride of one site can land on another's stream, the collisions two fixed prime strides
once made), the same ones give the same seed on every machine and every resume. 62 bits leave room for vLLM, which
seeds a request's j-th sample with its seed + j, under torch's 64-bit limit.

The purposes, and where each is drawn:"""

from __future__ import annotations

import zlib

import numpy as np

PURPOSES = {
    "rollout": "the trainer's generation call: coordinates step, refill (dynamic sampling's extra batches)",
    "rank": "a rank's (or tensor-parallel group's) share of a generation call: coordinate rank",
    "engine": "a rollout engine's own generators at start (32 bits: vLLM seeds numpy with it): coordinate rank "
              "(the group leader's)",
    "dropout": "a training rank's torch generator (dropout) at start: coordinate rank",
    "trajectory": "an agent-loop request: coordinates index (the trajectory's place in the rank's batch), call (its "
                  "requests before)",
    "prompt": "a prompt of an engine call (vLLM adds the sample's index): coordinate prompt",
}
__doc__ += "".join(f"\n- {name}: {what}" for name, what in PURPOSES.items())

SEED_BITS = 62


def _word(name: str) -> int:
    return zlib.crc32(name.encode())


def derive_seed(base: int, purpose: str, *, bits: int = SEED_BITS, **coordinates: int) -> int:
    """The seed of `purpose`'s stream at `coordinates` (non-negative integers) for the run seeded `base`: its first
    `bits` bits (fewer for a consumer that takes fewer, e.g. 32)."""
    if purpose not in PURPOSES:
        raise ValueError(f"derive_seed: unknown purpose {purpose!r}, expected one of {sorted(PURPOSES)}")
    key = [_word(purpose)]
    for name in sorted(coordinates):
        value = coordinates[name]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"derive_seed({purpose!r}): coordinate {name}={value!r} must be a non-negative integer")
        key += [_word(name), int(value)]
    if isinstance(base, bool) or not isinstance(base, (int, np.integer)):
        raise ValueError(f"derive_seed: the base seed must be an integer, got {base!r}")
    words = np.random.SeedSequence(int(base) % 2**64, spawn_key=key).generate_state(2, dtype=np.uint32)
    if not 1 <= bits <= 64:
        raise ValueError(f"derive_seed: bits={bits}, expected 1 to 64")
    return (int(words[0]) << 32 | int(words[1])) >> (64 - bits)
