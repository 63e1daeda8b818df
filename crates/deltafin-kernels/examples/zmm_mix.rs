//! Issue-rate probe behind the MXFP4 kernel's design (`bench/NOTES.md`, "MXFP4 matvec, session
//! 5"): cycles per group of independent 512-bit operations on this core, with the clock taken
//! from a chain of dependent integer adds (one cycle each). It shows the ceiling of the exact
//! MXFP4 matvec: at most two 512-bit vector operations per cycle (four 256-bit pipes), one per
//! cycle of each of FMA, shuffle and shift, and one 64-byte chunk (128 weights) needs 26 of them
//! (8 lookups, 7 shifts, 8 products, 1 scale spread, 1 add, 1 scale FMA): at least 13 cycles,
//! 0.89 ns per 32-weight block at 3.67 GHz, whatever the memory does.
//!
//! ```text
//! cargo run --release -p deltafin-kernels --example zmm_mix
//! ```
//!
//! x86-64 with AVX-512F only; elsewhere it says so and exits.

#[cfg(target_arch = "x86_64")]
mod probe {
    use std::arch::asm;
    use std::time::Instant;

    /// Seconds of the fastest of 5 calls of `run`.
    fn best_of_5(mut run: impl FnMut()) -> f64 {
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = Instant::now();
            run();
            best = best.min(t.elapsed().as_secs_f64());
        }
        best
    }

    /// Seconds per iteration of `$body` (16 operations on registers 0-15 from 20 and 21), best
    /// of 5 runs of `ITERS` iterations.
    macro_rules! per_iter {
        ($body:expr) => {{
            const ITERS: u64 = 2_000_000;
            // SAFETY: register-only AVX-512F instructions (checked by the caller); every
            // register written is declared clobbered.
            let best = best_of_5(|| unsafe {
                asm!(
                    "vpxord zmm20, zmm20, zmm20", "vpxord zmm21, zmm21, zmm21",
                    "2:", $body, "dec {i}", "jnz 2b",
                    i = inout(reg) ITERS => _,
                    out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                    out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                    out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                    out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                    out("zmm20") _, out("zmm21") _,
                    options(nostack, nomem),
                );
            });
            best / ITERS as f64
        }};
    }

    /// Clock in Hz: 64 dependent one-cycle adds per iteration.
    fn clock_hz() -> f64 {
        const ITERS: u64 = 5_000_000;
        // SAFETY: integer register arithmetic only.
        let best = best_of_5(|| unsafe {
            asm!(
                "2:",
                ".rept 64", "add {x}, 1", ".endr",
                "dec {i}", "jnz 2b",
                i = inout(reg) ITERS => _, x = inout(reg) 0u64 => _,
                options(nostack, nomem),
            );
        });
        64.0 * ITERS as f64 / best
    }

    pub fn run() {
        if !is_x86_feature_detected!("avx512f") {
            println!("zmm_mix: this CPU has no AVX-512F");
            return;
        }
        let hz = clock_hz();
        println!("clock ≈ {:.2} GHz (dependent adds)", hz / 1e9);
        let row = |name: &str, ops: f64, secs: f64| {
            let cyc = secs * hz;
            println!("{name:52} {cyc:6.2} cycles  {:.2} ops/cycle", ops / cyc);
        };
        macro_rules! x16 {
            ($op:literal) => {
                concat!(
                    $op,
                    " zmm0, zmm20, zmm21\n",
                    $op,
                    " zmm1, zmm20, zmm21\n",
                    $op,
                    " zmm2, zmm20, zmm21\n",
                    $op,
                    " zmm3, zmm20, zmm21\n",
                    $op,
                    " zmm4, zmm20, zmm21\n",
                    $op,
                    " zmm5, zmm20, zmm21\n",
                    $op,
                    " zmm6, zmm20, zmm21\n",
                    $op,
                    " zmm7, zmm20, zmm21\n",
                    $op,
                    " zmm8, zmm20, zmm21\n",
                    $op,
                    " zmm9, zmm20, zmm21\n",
                    $op,
                    " zmm10, zmm20, zmm21\n",
                    $op,
                    " zmm11, zmm20, zmm21\n",
                    $op,
                    " zmm12, zmm20, zmm21\n",
                    $op,
                    " zmm13, zmm20, zmm21\n",
                    $op,
                    " zmm14, zmm20, zmm21\n",
                    $op,
                    " zmm15, zmm20, zmm21\n"
                )
            };
        }
        row("16 x vfmadd231ps", 16.0, per_iter!(x16!("vfmadd231ps")));
        row("16 x vpermps", 16.0, per_iter!(x16!("vpermps")));
        row("16 x vpermw", 16.0, per_iter!(x16!("vpermw")));
        row("16 x vpsrlvd", 16.0, per_iter!(x16!("vpsrlvd")));
        row("16 x vpandd", 16.0, per_iter!(x16!("vpandd")));
        row("16 x vaddps", 16.0, per_iter!(x16!("vaddps")));
        // One chunk of the MXFP4 row kernel, spread evenly: 9 shuffles (8 lookups, the scale
        // spread), 7 immediate shifts, 10 floating-point operations (8 products, the add of the
        // two chains, the scale FMA).
        row(
            "one MXFP4 chunk: 9 vpermps + 7 vpsrld + 10 FMA/add",
            26.0,
            per_iter!(concat!(
                "vpermps zmm0, zmm20, zmm21\n vpsrld zmm1, zmm20, 4\n vfmadd231ps zmm2, zmm20, zmm21\n",
                "vpermps zmm3, zmm20, zmm21\n vfmadd231ps zmm4, zmm20, zmm21\n vpsrld zmm5, zmm20, 8\n",
                "vpermps zmm6, zmm20, zmm21\n vfmadd231ps zmm7, zmm20, zmm21\n vpsrld zmm8, zmm20, 12\n",
                "vpermps zmm9, zmm20, zmm21\n vfmadd231ps zmm10, zmm20, zmm21\n vpsrld zmm11, zmm20, 16\n",
                "vpermps zmm12, zmm20, zmm21\n vfmadd231ps zmm13, zmm20, zmm21\n vpsrld zmm14, zmm20, 20\n",
                "vpermps zmm15, zmm20, zmm21\n vfmadd231ps zmm0, zmm20, zmm21\n vpsrld zmm1, zmm20, 24\n",
                "vpermps zmm2, zmm20, zmm21\n vfmadd231ps zmm3, zmm20, zmm21\n vpsrld zmm4, zmm20, 28\n",
                "vpermps zmm5, zmm20, zmm21\n vfmadd231ps zmm6, zmm20, zmm21\n vaddps zmm7, zmm20, zmm21\n",
                "vpermps zmm8, zmm20, zmm21\n vfmadd231ps zmm9, zmm20, zmm21\n vfmadd231ps zmm10, zmm20, zmm21\n",
            )),
        );
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    probe::run();
    #[cfg(not(target_arch = "x86_64"))]
    println!("zmm_mix: x86-64 only");
}
