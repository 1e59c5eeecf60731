"""What each word of a kernel's argument block is, from its layout and its C++ types
(graphguard._demangle): the corpus of argument forms provenance decides, on any CPU (the
names are the H200's, as ``cuFuncGetName`` gave them)."""

from __future__ import annotations

import pytest

from graphguard._demangle import OPAQUE, POINTER, SCALAR, demangle, kind_of, param_types
from graphguard._demangle import word_kinds as kinds

MUL = (
    "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_13BinaryFunctorIfffNS0_15binary_"
    "internal10MulFunctorIfEEEESt5arrayIPcLm3EEEEviT0_T1_"
)
UNROLLED = (
    "_ZN2at6native27unrolled_elementwise_kernelINS0_13BinaryFunctorIfffNS0_15binary_internal"
    "10MulFunctorIfEEEESt5arrayIPcLm3EELi4E23TrivialOffsetCalculatorILi2EjESA_ILi1EjENS0_6"
    "memory12LoadWithCastILi2EEENSD_13StoreWithCastILi1EEEEEviT_T0_T2_T3_T4_T5_"
)
CLOSURE = (
    "_ZN2at6native18elementwise_kernelILi128ELi4EZNS0_22gpu_kernel_impl_nocastINS0_13Binary"
    "FunctorIlllNS0_15binary_internal10MulFunctorIlEEEEEEvRNS_18TensorIteratorBaseERKT_EUliE_"
    "EEviT1_"
)


def test_names_demangle_and_split_into_parameter_types() -> None:
    assert demangle("triton_poi_fused_add_0") == "triton_poi_fused_add_0"
    assert param_types(demangle(MUL)) == [
        "int",
        "at::native::BinaryFunctor<float, float, float, "
        "at::native::binary_internal::MulFunctor<float> >",
        "std::array<char*, 3ul>",
    ]
    closure = param_types(demangle(CLOSURE))
    assert closure is not None and len(closure) == 2 and closure[1].endswith("{lambda(int)#1}")
    assert param_types("sm90_xmma_gemm_bf16") is None


def test_an_operand_array_is_three_pointers_and_its_scalars_are_not() -> None:
    got, aten = kinds(MUL, [(0, 4), (4, 1), (8, 24)], 32)
    assert list(got) == [SCALAR, POINTER, POINTER, POINTER] and aten


def test_offset_calculators_and_casts_hold_no_pointer() -> None:
    params = [(0, 4), (4, 1), (8, 24), (32, 8), (40, 8), (48, 16), (64, 8)]
    got, aten = kinds(UNROLLED, params, 72)
    assert list(got) == [SCALAR, POINTER, POINTER, POINTER, SCALAR, SCALAR, SCALAR, SCALAR, SCALAR]
    assert aten


def test_a_closure_is_opaque() -> None:
    got, aten = kinds(CLOSURE, [(0, 4), (8, 640)], 648)
    assert got[0] == SCALAR and set(got[1:]) == {OPAQUE} and aten


@pytest.mark.parametrize(
    ("ctype", "size", "want"),
    [
        ("float const*", 8, [POINTER]),
        ("long", 8, [SCALAR]),
        ("at::cuda::detail::TensorInfo<float, unsigned int>", 216, [POINTER] + [SCALAR] * 26),
        ("at::PhiloxCudaState", 32, [POINTER, POINTER, SCALAR, SCALAR]),
        ("OffsetCalculator<3, unsigned int, false>", 608, [SCALAR] * 76),
        ("std::array<long, 2ul>", 16, [SCALAR, SCALAR]),
        ("at::detail::Array<char*, 4>", 32, [POINTER] * 4),
        ("at::native::ReduceOp<float, at::native::MeanOps<float, float>>", 400, [OPAQUE] * 50),
    ],
)
def test_each_type_says_what_its_words_are(ctype: str, size: int, want: list[int]) -> None:
    assert kind_of(ctype, size) == want


def test_a_kernel_without_types_has_whole_pointer_parameters_and_opaque_blocks() -> None:
    """Triton's and cuBLAS's kernels carry no C++ types: a whole 8-byte parameter is a
    pointer, a larger one (a packed parameter block) opaque, a small one no pointer."""
    got, aten = kinds("triton_poi_fused_mul_0", [(0, 8), (8, 8), (16, 4)], 24)
    assert list(got) == [POINTER, POINTER, SCALAR] and not aten
    got, aten = kinds("sm90_xmma_gemm_bf16bf16", [(0, 384)], 384)
    assert set(got) == {OPAQUE} and not aten
