import pytest
import torch

from slimlm.packing import pack_codes, unpack_codes


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_round_trips_and_wastes_no_bit(bits):
    codes = torch.randint(
        0, 2**bits, (7, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits)
    )
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 96 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_known_layout_of_four_and_three_bit_codes():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x43, 0x65, 0x07]]  # code 2i in the low nibble of byte i
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes[0]))
    assert pack_codes(codes, 3).tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]


def test_unpackable_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_codes(torch.zeros(2, 12, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="5-bit"):
        pack_codes(torch.zeros(2, 16, dtype=torch.uint8), 5)
