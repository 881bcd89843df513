"""bench/hlo_kernels.py: launches per call counted from optimized HLO text (loops at their trip counts, the
predicate copies, a conditional's largest branch, calls walked, free ops skipped)."""
import pytest

from bench.hlo_kernels import count_launches, parse_module

HLO = """HloModule jit_step, is_scheduled=true

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%inner_body (ib: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ib = (s32[], f32[4]{0}) parameter(0)
  %ix = f32[4]{0} get-tuple-element(%ib), index=1
  %inner_fusion = f32[4]{0} fusion(%ix), kind=kLoop, calls=%fused_a
  ROOT %it = (s32[], f32[4]{0}) tuple(%ix, %inner_fusion)
}

%inner_cond (ic: (s32[], f32[4])) -> pred[] {
  %ic = (s32[], f32[4]{0}) parameter(0)
  ROOT %inner_cmp = pred[] fusion(%ic), kind=kLoop, calls=%fused_a
}

%outer_body (ob: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ob = (s32[], f32[4]{0}) parameter(0)
  %body_f1 = f32[4]{0} fusion(%ob), kind=kLoop, calls=%fused_a
  %body_f2 = f32[4]{0} custom-call(%body_f1), custom_call_target="__gpu$xla.gpu.triton", calls=%fused_a
  %inner = (s32[], f32[4]{0}) while(%ob), condition=%inner_cond, body=%inner_body, INNER_TRIP
  ROOT %ot = (s32[], f32[4]{0}) tuple(%inner)
}

%outer_cond (oc: (s32[], f32[4])) -> pred[] {
  %oc = (s32[], f32[4]{0}) parameter(0)
  ROOT %outer_cmp = pred[] fusion(%oc), kind=kLoop, calls=%fused_a
}

%branch_small (b0: f32[4]) -> f32[4] {
  %b0 = f32[4]{0} parameter(0)
  ROOT %small_f = f32[4]{0} fusion(%b0), kind=kLoop, calls=%fused_a
}

%branch_big (b1: f32[4]) -> f32[4] {
  %b1 = f32[4]{0} parameter(0)
  %big_f1 = f32[4]{0} fusion(%b1), kind=kLoop, calls=%fused_a
  ROOT %big_f2 = f32[4]{0} fusion(%big_f1), kind=kLoop, calls=%fused_a
}

%called (c: f32[4]) -> f32[4] {
  %c = f32[4]{0} parameter(0)
  ROOT %called_copy = f32[4]{0} copy(%c)
}

ENTRY %main (x: f32[4], k: s32[]) -> (f32[4], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %k = s32[] parameter(1)
  %one = f32[] constant(1)
  %bc = f32[4]{0} bitcast(%x)
  %entry_fusion = f32[4]{0} fusion(%bc), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/neg"}
  %gemm = (f32[4]{0}, s8[16]{0}) custom-call(%entry_fusion), custom_call_target="__cublas$gemm"
  %loop = (s32[], f32[4]{0}) while(%gemm), condition=%outer_cond, body=%outer_body, OUTER_TRIP
  %pick = f32[4]{0} conditional(%k, %x, %x), branch_computations={%branch_small, %branch_big}
  %cl = f32[4]{0} call(%pick), to_apply=%called
  %ar = f32[4]{0} all-reduce-start(%cl), replica_groups={}, to_apply=%fused_a
  %ard = f32[4]{0} all-reduce-done(%ar)
  ROOT %out = (f32[4]{0}, f32[4]{0}) tuple(%ard, %pick)
}
"""
OUTER_TRIP = 'backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}'
HLO = HLO.replace("INNER_TRIP", 'backend_config={"known_trip_count":{"n":"2"}}').replace("OUTER_TRIP", OUTER_TRIP)


def test_counts_loops_branches_calls_and_skips_free_ops():
    entry, comps = parse_module(HLO)
    assert entry == "main" and {"outer_body", "inner_cond", "branch_big"} <= set(comps)
    loop = next(i for i in comps["main"] if i.name == "loop")
    assert loop.opcode == "while" and loop.trip == 3 and loop.called == {"condition": "outer_cond",
                                                                          "body": "outer_body"}
    c = count_launches(HLO)
    # per outer trip: 2 body kernels + the inner loop (2 body trips, 3 condition evaluations)
    per_outer = 2 + 2 * 1 + 3 * 1
    expected = {"entry_fusion": 1, "gemm": 1, "body_f1": 3, "body_f2": 3, "inner_fusion": 3 * 2,
                "inner_cmp": 3 * 3, "outer_cmp": 4, "big_f1": 1, "big_f2": 1, "called_copy": 1, "ar": 1}
    assert dict(c.launches) == expected
    assert sum(expected.values()) == 1 + 1 + 3 * per_outer + 4 + 2 + 1 + 1
    # predicate copies: 4 outer evaluations, 3 x 3 inner ones, one per conditional
    assert c.predicate_copies == 4 + 9 + 1
    assert c.total == sum(expected.values()) + 14
    assert c.conditionals == [{"name": "pick", "branch_launches": [1, 2]}] and c.unknown_trip_loops == []


def test_unknown_trip_count_is_reported_and_no_entry_is_an_error():
    text = HLO.replace(OUTER_TRIP, "")
    c = count_launches(text)
    assert c.unknown_trip_loops == ["loop"] and c.launches["body_f1"] == 1
    with pytest.raises(ValueError, match="ENTRY"):
        count_launches(HLO.replace("ENTRY %main", "%main"))
