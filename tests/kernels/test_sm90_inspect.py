"""The SASS check for register-A wgmma races (``sm90_inspect.sass_register_a_hazards``) on
hand-written listings: a pipelined wait (``DEPBAR.LE gsb0, 0x1``) retires an MMA only once a
newer group is committed, so a write to its A registers before then is a race and one after is
not; a loop's back edge is followed once."""

from __future__ import annotations

from sm90_inspect import sass_register_a_hazards


def listing(*instructions: str) -> list[tuple[int, str]]:
    return [(0x10 * (i + 1), ins) for i, ins in enumerate(instructions)]


MMA_A = "HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR4], R24, gsb0"
MMA_B = "HGMMA.64x128x16.F32.BF16 R24, R100, gdesc[UR4], R24, gsb0"
WAIT_1 = "WARPGROUP.DEPBAR.LE gsb0, 0x1"


def test_pipelined_wait_retires_the_older_group() -> None:
    code = listing(MMA_A, WAIT_1, "LDS R100, [R2]", MMA_B, WAIT_1, "LDS R88, [R2]")
    assert sass_register_a_hazards(code) == []


def test_write_before_the_retiring_wait_is_a_race() -> None:
    # R88 rewritten while only one newer group may be in flight: the first MMA may still read it
    code = listing(MMA_A, WAIT_1, "LDS R88, [R2]", MMA_B, WAIT_1)
    found = sass_register_a_hazards(code)
    assert len(found) == 1 and "LDS R88" in found[0] and "0x0010" in found[0]


def test_a_full_wait_retires_everything() -> None:
    code = listing(MMA_A, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "LDS R88, [R2]")
    assert sass_register_a_hazards(code) == []


def test_the_back_edge_is_followed() -> None:
    # the loop's next trip rewrites R88 (an LDS.64 writes R88-R89) before its wait retires it
    code = listing("LDS.64 R88, [R2]", MMA_A, WAIT_1, "BRA 0x10")
    found = sass_register_a_hazards(code)
    assert len(found) == 1 and "LDS.64 R88" in found[0]
    # the next trip's MMA commits a newer group and its wait retires this one before the rewrite
    code = listing(MMA_B, WAIT_1, "LDS.64 R88, [R2]", MMA_A, WAIT_1, "BRA 0x10")
    assert sass_register_a_hazards(code) == []
