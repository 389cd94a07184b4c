# Emits the wgmma wrappers of flash_wgmma.cu (operand lists are long; written out by this script).
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
