# Emits the wgmma wrappers of flash_wgmma.cu (wrappers.inc) and mx_gemm_wgmma.cu (mx_wrappers.inc):
# the operand lists are long, so this script writes them out.
def regs(a, b): return ", ".join(f"%{i}" for i in range(a, b))
out = []
def ss(n):
    k = n // 2
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(k))
    out.append(f"""// d (+)= A·B, m64n{n}k16: A (64×16, K-major) and B ({n}×16, K-major) in shared memory.
__device__ __forceinline__ void fw_mma_ss{n}(float (&d)[{k}], u64 da, u64 db, int acc) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k+2}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs(0, k)}}}, %{k}, %{k+1}, p, 1, 1, 0, 0;\\n}}\\n"
        : {cons}
        : "l"(da), "l"(db), "r"(acc));
}}
""")
def rs(n):
    k = n // 2
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(k))
    out.append(f"""// d (+)= A·B, m64n{n}k16: A (64×16) in registers, B (16×{n}, N-major: transposed) in shared
// memory.
__device__ __forceinline__ void fw_mma_rs{n}(float (&d)[{k}], const uint32_t (&a)[4], u64 db, int acc) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k+5}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs(0, k)}}}, {{%{k}, %{k+1}, %{k+2}, %{k+3}}}, %{k+4}, p, 1, 1, 1;\\n}}\\n"
        : {cons}
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}}
""")
ss(128); ss(64); ss(32); rs(64); rs(128)
open("wrappers.inc", "w").write("\n".join(out))

# The FP8 product of one MX block (k = 32) from zero (scale-d false), both operands K-major in
# shared memory (the only layout wgmma takes for 8-bit types), one wrapper per (A, B) format.
def fp8(n):
    k = n // 2
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(k))
    body = []
    for a5, b5 in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        ta, tb = ("e5m2" if a5 else "e4m3"), ("e5m2" if b5 else "e4m3")
        body.append(f"""    {"if" if not body else "} else if"} constexpr ({"" if a5 else "!"}A5 && {"" if b5 else "!"}B5) {{
        asm volatile(
            "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k+2}, 0;\\n"
            "wgmma.mma_async.sync.aligned.m64n{n}k32.f32.{ta}.{tb} {{{regs(0, k)}}}, %{k}, %{k+1}, p, 1, 1;\\n}}\\n"
            : {cons}
            : "l"(da), "l"(db), "r"(0));""")
    mx.append(f"""// d = A·B from zero, m64n{n}k32: A (64×32) and B ({n}×32) fp8 (E4M3, or E5M2 where A5 / B5),
// K-major, in shared memory.
template <bool A5, bool B5>
__device__ __forceinline__ void mxw_mma{n}(float (&d)[{k}], u64 da, u64 db) {{
""" + "\n".join(body) + "\n    }\n}\n")
mx = []
fp8(128)
open("mx_wrappers.inc", "w").write("\n".join(mx))
