//! Where a decode step's time goes on the GPU: each launch of one MoE layer of the `bench`
//! preset's shape (hidden 2,048, q-LoRA 512, 16 heads of 64 + 32, latent 256, 256 routed MXFP4
//! experts of 1,024, top-8, one int8 shared expert), timed alone with CUDA events (median of 50
//! after 2 warm-ups), then 16 layers queued back to back as a token queues them (device time and
//! host wall time), so the gap between the sum of the launches and the token's time is visible.
//!
//! `cargo run --release -p deltafin-cuda --example decode_profile` (or the built binary on the GPU
//! machine). Random weights: the times do not depend on the values.

use std::time::Instant;

use deltafin_cuda::{
    CudaError, CudaSlice, Gpu, GpuBuf, GpuMat, MlaPrefillForm, MlaPrepArg, MoeDown, MvJob, PreNorm, RouteTailArg,
    RouterShape,
};
use deltafin_kernels::{MatData, MatRef};
use rand::{rngs::StdRng, SeedableRng};

mod common;
use common::{mxfp4_expert, rand_vec};

fn int8_mat(g: &Gpu, rng: &mut StdRng, rows: usize, cols: usize) -> GpuMat {
    common::int8_upload(g, &rand_vec(rng, rows * cols), rows, cols)
}

fn f32_mat(g: &Gpu, rng: &mut StdRng, rows: usize, cols: usize) -> GpuMat {
    let w = rand_vec(rng, rows * cols);
    GpuMat::upload(g, &MatRef::new(rows, cols, MatData::F32(&w)).unwrap()).unwrap()
}

fn main() -> Result<(), CudaError> {
    let g = common::open_gpu("decode_profile");
    println!("device: {} (compute {:?})", g.info().name, g.info().compute_capability);
    let mut rng = StdRng::seed_from_u64(7);
    let s = common::MLA_BENCH;
    let (nh, nope, rope, vd, kvl) = (s.n_heads, s.nope, s.rope, s.v_head_dim, s.kv_lora_rank);
    let (h, ql, inter, n_exp, k) = (2048, 512, 1024, 256, 8);
    let q_a = int8_mat(&g, &mut rng, ql, h);
    let kv_lat = int8_mat(&g, &mut rng, kvl, h);
    let kv_rope = int8_mat(&g, &mut rng, rope, h);
    let q_b = int8_mat(&g, &mut rng, nh * (nope + rope), ql);
    let kv_b = int8_mat(&g, &mut rng, nh * (nope + vd), kvl);
    let o_proj = int8_mat(&g, &mut rng, h, nh * vd);
    let sh_gate = int8_mat(&g, &mut rng, inter, h);
    let sh_up = int8_mat(&g, &mut rng, inter, h);
    let sh_down = int8_mat(&g, &mut rng, h, inter);
    let router = f32_mat(&g, &mut rng, n_exp, h);
    let experts: Vec<[GpuMat; 3]> = (0..n_exp).map(|_| mxfp4_expert(&g, &mut rng, inter, h)).collect();
    let mut table = g.expert_table(n_exp, inter, h)?;
    table.set(&g, 0, &experts.iter().collect::<Vec<_>>())?;
    let up = |v: Vec<f32>| g.upload(&v);
    let mut x = up(rand_vec(&mut rng, h).iter().map(|v| v * 0.1).collect())?;
    let norm_w = up(vec![1.0; h])?;
    let ql_norm = up(vec![1.0; ql])?;
    let kv_norm = up(vec![1.0; kvl])?;
    let bias = up(rand_vec(&mut rng, n_exp).iter().map(|v| v * 0.01).collect())?;
    let cs = up(rand_vec(&mut rng, rope))?;
    let z = |n: usize| g.zeros(n);
    let (mut qa, mut q, mut ckv, mut kpe) = (z(ql)?, z(nh * (nope + rope))?, z(kvl)?, z(rope)?);
    let (mut heads, mut xn, mut logits, mut shared_h) = (z(nh * vd)?, z(h)?, z(n_exp)?, z(inter)?);
    let mut moe_h = z(k * inter + (k + 1) * h)?;
    let mut ids = g.upload(&vec![0i32; 16 * k])?;
    let mut wts = z(16 * k)?;
    let t_long = 1000;
    let mut c_kv = up(rand_vec(&mut rng, t_long * kvl))?;
    let mut k_pe = up(rand_vec(&mut rng, t_long * rope))?;
    // MLA scratch for a 1,024-position cache (16 splits of 64): a captured step's grid.
    let mut scores = z(s.scratch_len(1024))?;
    let pos15 = g.upload(&[15i32])?;
    let rs = RouterShape {
        n_experts: n_exp,
        top_k: k,
        n_group: 8,
        topk_group: 4,
        norm_topk_prob: true,
        routed_scaling_factor: 2.5,
    };
    let reps = 50;
    let us = |ms: f32| ms * 1000.0;
    let mut total = 0.0f32;
    let mut row = |name: &str, t: f32, count: bool| {
        if count {
            total += t;
        }
        println!("{name:<58} {:>8.1} us", us(t));
    };

    let t = g.time_ms(reps, || g.rms_norm(&x, &norm_w, 1, 1e-6, false, &mut xn))?;
    row("rms_norm alone (reference)", t, false);
    let t = g.time_ms(reps, || sh_gate.matvec(&g, &xn, &mut shared_h))?;
    row("int8 matvec [1024, 2048] alone (reference)", t, false);
    let t = g.time_ms(reps, || experts[0][0].matvec(&g, &xn, &mut shared_h))?;
    row("MXFP4 matvec [1024, 2048] alone (reference)", t, false);
    // Variants of single launches (the layer's own launches are timed below, from `launch`).
    let t = g.time_ms(reps, || {
        g.mla_decode(
            s,
            &q,
            &c_kv,
            &k_pe,
            &kv_b,
            1000,
            0.1,
            Some((&cs, false)),
            None,
            &mut scores,
            &mut heads,
        )
    })?;
    row("mla_decode at 1000 positions", t, false);
    let t = g.time_ms(reps, || {
        let p = PreNorm::rms(&norm_w, 1e-6).kept_in(&mut xn);
        let jobs = &mut [
            MvJob::set(&router, &mut logits),
            MvJob::glu(&sh_gate, &sh_up, &mut shared_h),
        ];
        g.mv_jobs(&x, Some(p), jobs)
    })?;
    row("post norm + router + shared gate/up, no router tail", t, false);
    let t = g.time_ms(reps, || g.route_noaux(rs, &logits, 1, &bias, &mut ids, &mut wts, 0))?;
    row("route_noaux alone (256 experts, 8 groups, top-8)", t, false);
    // The layer's routed experts (the first k of `ids`, `wts`) and shared down projection, in `form`.
    let moe_table =
        |form, ids: &CudaSlice<i32>, wts: &GpuBuf, xn: &GpuBuf, h: &mut GpuBuf, sh: &GpuBuf, x: &mut GpuBuf| {
            g.moe_table(
                form,
                &table,
                &ids.slice(..k),
                &wts.slice(..k),
                k,
                xn,
                h,
                Some((&sh_down, sh)),
                x,
            )
        };
    let t = g.time_ms(reps, || {
        moe_table(MoeDown::Fused, &ids, &wts, &xn, &mut moe_h, &shared_h, &mut x)
    })?;
    row("moe_table Fused (8 experts + shared down)", t, false);

    // One MoE layer as decoding queues it, launch by launch.
    let mut launch = |i: usize| -> Result<(), CudaError> {
        match i {
            0 => g.mv_jobs(
                &x,
                Some(PreNorm::rms(&norm_w, 1e-6)),
                &mut [
                    MvJob::set(&q_a, &mut qa),
                    MvJob::set(&kv_lat, &mut ckv),
                    MvJob::set(&kv_rope, &mut kpe),
                ],
            ),
            1 => g.mv_jobs(&qa, Some(PreNorm::rms(&ql_norm, 1e-6)), &mut [MvJob::set(&q_b, &mut q)]),
            2 => g.mla_prep(MlaPrepArg {
                ckv_raw: &ckv,
                norm: &kv_norm,
                eps: 1e-6,
                kpe_raw: &kpe,
                cs: &cs,
                interleaved: false,
                pos: 15,
                pos_dev: &pos15,
                c_kv: &mut c_kv,
                k_pe: &mut k_pe,
            }),
            3 => g.mla_decode(
                s,
                &q,
                &c_kv,
                &k_pe,
                &kv_b,
                16,
                0.1,
                Some((&cs, false)),
                Some(&pos15),
                &mut scores,
                &mut heads,
            ),
            4 => g.mv_jobs(&heads, None, &mut [MvJob::add(&o_proj, &mut x)]),
            5 => {
                let p = PreNorm::rms(&norm_w, 1e-6).kept_in(&mut xn);
                let r = RouteTailArg {
                    cfg: rs,
                    bias: &bias,
                    ids: &mut ids,
                    weights: &mut wts,
                    off: 0,
                };
                let jobs = &mut [
                    MvJob::set(&router, &mut logits),
                    MvJob::glu(&sh_gate, &sh_up, &mut shared_h),
                ];
                g.mv_jobs_route(&x, Some(p), jobs, Some(r))
            }
            _ => moe_table(MoeDown::Split, &ids, &wts, &xn, &mut moe_h, &shared_h, &mut x),
        }
    };
    let names = [
        "1 mv_jobs: input norm + q_a, latent, rope key (800 rows)",
        "2 mv_jobs: q_a norm + q_b (1536 rows)",
        "3 mla_prep",
        "4 mla_decode at 16 positions",
        "5 mv_jobs: o_proj + residual (2048 rows)",
        "6 post norm + router (f32) + shared gate/up, router in the last block",
        "7 moe_table Split (8 experts + shared down)",
    ];
    for (i, name) in names.iter().enumerate() {
        let t = g.time_ms(reps, || launch(i))?;
        row(name, t, true);
    }
    println!(
        "{:<58} {:>8.1} us",
        "sum of 1-7 (one MoE layer, 16 positions)",
        us(total)
    );
    let mut layer = || -> Result<(), CudaError> { (0..names.len()).try_for_each(&mut launch) };
    let t = g.time_ms(20, || {
        for _ in 0..16 {
            layer()?;
        }
        Ok(())
    })?;
    g.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..20 {
        for _ in 0..16 {
            layer()?;
        }
        g.synchronize()?;
    }
    let wall = t0.elapsed().as_secs_f32() / 20.0;
    let t1 = Instant::now();
    for _ in 0..20 {
        for _ in 0..16 {
            layer()?;
        }
    }
    let host = t1.elapsed().as_secs_f32() / 20.0;
    g.synchronize()?;
    println!(
        "16 layers queued: device {:.1} us, host wall with sync {:.1} us, host queuing alone {:.1} us ({:.1} us a launch)",
        us(t),
        wall * 1e6,
        host * 1e6,
        host * 1e6 / (16.0 * 7.0)
    );

    // Prefill of 2,000 tokens, one layer: the matrix-matrix products and MLA for the chunk, and
    // one expert's share of the expert-major MoE (2,000 x 8 / 256 = 62 tokens an expert).
    let n = 2000usize;
    let xs = up(rand_vec(&mut rng, n * h))?;
    let mut total = 0.0f32;
    let mut row = |name: &str, t: f32, times: f32| {
        total += t * times;
        println!("{name:<58} {:>8.1} us x {times:>4} = {:>9.1} us", us(t), us(t * times));
    };
    let mut y = z(n * 2048)?;
    let mut yq = z(n * nh * (nope + rope))?;
    let xq = up(rand_vec(&mut rng, n * ql))?;
    let xo = up(rand_vec(&mut rng, n * nh * vd))?;
    let mut ys = z(n * ql)?;
    let t = g.time_ms(5, || q_a.matmul(&g, &xs, n, &mut ys))?;
    row("P int8 matmul q_a [512, 2048] x 2000", t, 1.0);
    let t = g.time_ms(5, || q_b.matmul(&g, &xq, n, &mut yq))?;
    row("P int8 matmul q_b [1536, 512] x 2000", t, 1.0);
    let t = g.time_ms(5, || o_proj.matmul(&g, &xo, n, &mut y))?;
    row("P int8 matmul o_proj [2048, 1024] x 2000", t, 1.0);
    let mut yi = z(n * inter)?;
    let t = g.time_ms(5, || sh_gate.matmul(&g, &xs, n, &mut yi))?;
    row("P int8 matmul shared gate/up [1024, 2048] x 2000", t, 2.0);
    let t = g.time_ms(5, || sh_down.matmul(&g, &yi, n, &mut y))?;
    row("P int8 matmul shared down [2048, 1024] x 2000", t, 1.0);
    let mut yr = z(n * n_exp)?;
    let t = g.time_ms(5, || router.matmul(&g, &xs, n, &mut yr))?;
    row("P f32 matmul router [256, 2048] x 2000", t, 1.0);
    let lat = up(rand_vec(&mut rng, n * kvl))?;
    let kp = up(rand_vec(&mut rng, n * rope))?;
    let mut sc = z(n * s.scratch_len(n))?;
    let mut ho = z(n * nh * vd)?;
    let t = g.time_ms(3, || {
        g.mla_prefill(
            MlaPrefillForm::best(s),
            s,
            &yq,
            &lat,
            &kp,
            &kv_b,
            0,
            n,
            0.1,
            &mut sc,
            &mut ho,
        )
    })?;
    row("P mla_prefill 2000 tokens from position 0", t, 1.0);
    let (m, e) = (62usize, &experts[1]);
    let xe = up(rand_vec(&mut rng, m * h))?;
    let mut ye = z(m * inter)?;
    let t = g.time_ms(reps, || e[0].matmul(&g, &xe, m, &mut ye))?;
    row("P MXFP4 matmul expert gate/up [1024, 2048] x 62", t, 2.0 * 256.0);
    let xd = up(rand_vec(&mut rng, m * inter))?;
    let mut yd = z(m * h)?;
    let t = g.time_ms(reps, || e[2].matmul(&g, &xd, m, &mut yd))?;
    row("P MXFP4 matmul expert down [2048, 1024] x 62", t, 256.0);
    let t = g.time_ms(reps, || g.rms_norm(&xs, &norm_w, n, 1e-6, false, &mut y))?;
    row("P rms_norm 2000 rows", t, 3.0);
    println!(
        "{:<58} {:>8.1} ms a layer; x 17 layers = {:.1} ms for 2,000 tokens",
        "P sum",
        total,
        total * 17.0
    );
    Ok(())
}
