"""scripts/sass_stats.py: the opcode reader and the pipe table on a cuobjdump listing (lines as the H200's
cuobjdump 13 prints them for the FP4 decode)."""

import sass_stats as ss

LISTING = """
        Function : expert_gemm_fp4_mosaic_gpu_kernel
        /*23d0*/                   IMAD.SHL.U32 R5, R36.reuse, 0x10, RZ ;                     /* 0x0000001024057824 */
                                                                                              /* 0x000fe200078e00ff */
        /*23e0*/                   SHF.L.W.U32.HI R27, R36.reuse, 0xa, R36.reuse ;            /* 0x0000000a241b7819 */
        /*2400*/                   LOP3.LUT R4, R36, 0x81c081c0, RZ, 0xc0, !PT ;              /* 0x81c081c024047812 */
        /*2440*/                   LDS.U8 R36, [R2+0x14c08] ;                                 /* 0x014c080002247984 */
        /*2760*/                   HMUL2.BF16_V2 R32, R4, R3 ;                                /* 0x0000000304207232 */
        /*2290*/              @!P3 BRA 0x6640 ;                                               /* 0x0000004000b0b947 */
        /*2b40*/                   HGMMA.64x8x16.F32.BF16 R28, R32, gdesc[UR8], R28 ;         /* 0x00e00008201c79f0 */
        /*2b50*/                   UIADD3 UR10, UP0, UR10, 0x2, URZ ;                         /* 0x000000020a0a7890 */
        /*1a2b0*/                  R2UR UR4, R3 ;                                             /* 0x00000000030472ca */
"""


def test_opcodes_and_pipes():
    ops = ss.opcodes(LISTING)
    assert ops == ["IMAD.SHL.U32", "SHF.L.W.U32.HI", "LOP3.LUT", "LDS.U8", "HMUL2.BF16_V2", "BRA",
                   "HGMMA.64x8x16.F32.BF16", "UIADD3", "R2UR"]  # the encoding lines and the predicate are not ops
    assert [ss.pipe_of(o) for o in ops] == ["fma", "alu", "alu", "lsu", "fma", "other", "tensor", "uniform",
                                            "uniform"]


def test_region_is_the_first_stretch_between_the_two_matches():
    r = ss.opcodes(ss.region(LISTING, r"SHF\.L\.W", r"HMUL2"))
    assert r == ["SHF.L.W.U32.HI", "LOP3.LUT", "LDS.U8", "HMUL2.BF16_V2"]
