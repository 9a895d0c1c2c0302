//! The batched decode attention on the test device (on CUDA our kernel, in warps and in teams)
//! against attention written out with tensor ops, row by row: a prompt chunk at the end of a long
//! conversation beside single rows of other streams, in a 4096- and a 12288-position slot (each
//! block of the kernel over a span of several chunks), and a lone row (spans of one chunk); four
//! query heads a KV head of 128 (the Thinker's), one of 64 (the Talker's), and eight of 32.

use super::*;
use antiphon_models::attention::{attend, CausalMask};
use antiphon_models::batch_decode::{decode_attention_batch, set_decode_attention_teams};
use candle_core::Device;

/// One row's attention over positions `0..p` of its slot and its own K and V, on the host in f32.
fn row_attention(heads: &Tensor, kc: &Tensor, vc: &Tensor, slot: usize, p: usize) -> Tensor {
    let hkv = kc.dim(1).unwrap();
    let (rows, d) = heads.dims2().unwrap();
    let hq = rows - 2 * hkv;
    let (q, k_new, v_new) = (
        heads.narrow(0, 0, hq).unwrap(),
        heads.narrow(0, hq, hkv).unwrap(),
        heads.narrow(0, hq + hkv, hkv).unwrap(),
    );
    let k = Tensor::cat(
        &[kc.get(slot).unwrap().narrow(1, 0, p).unwrap(), k_new.unsqueeze(1).unwrap()],
        1,
    )
    .unwrap();
    let v = Tensor::cat(
        &[vc.get(slot).unwrap().narrow(1, 0, p).unwrap(), v_new.unsqueeze(1).unwrap()],
        1,
    )
    .unwrap();
    attend(&q.reshape((hq, 1, d)).unwrap(), &k, &v, &CausalMask::Open)
        .unwrap()
        .reshape((hq, d))
        .unwrap()
}

#[test]
fn batched_attention_over_a_long_prompt_chunk_matches_attention_row_by_row() {
    // (process-wide; on CUDA both forms are checked, the default restored; elsewhere the twin
    // runs whatever the form)
    let forms: &[bool] = if common::device().is_cuda() { &[false, true] } else { &[false] };
    for &teams in forms {
        set_decode_attention_teams(teams);
        for cap in [4096, 12288] {
            attention_in_slots_of(cap, (8, 2, 128), teams);
        }
        attention_in_slots_of(4096, (4, 4, 64), teams);
        // eight query heads a KV head, 32 wide (a team of four lanes)
        attention_in_slots_of(4096, (16, 2, 32), teams);
    }
    set_decode_attention_teams(false);
}

fn attention_in_slots_of(cap: usize, (hq, hkv, d): (usize, usize, usize), teams: bool) {
    let dev = common::device();
    // slot 1: a prompt chunk of 40 rows ~1100 positions before the end; slot 0 rows at 17 and
    // at 32 (a whole number of chunks); slot 2 the slot's last position
    let at = cap as u32 - 1096;
    let mut rows: Vec<(u32, u32)> = (at..at + 40).map(|p| (1, p)).collect();
    rows.extend([(0, 17), (0, 32), (2, cap as u32 - 1)]);
    let b = rows.len();
    let max_pos = cap - 1;
    let host = Device::Cpu;
    let kc = Tensor::randn(0f32, 1.0, (3, hkv, cap, d), &host).unwrap();
    let vc = Tensor::randn(0f32, 1.0, (3, hkv, cap, d), &host).unwrap();
    let heads = Tensor::randn(0f32, 0.3, (b, hq + 2 * hkv, d), &host).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        // (the reference reads the inputs as the device does: rounded to the dtype)
        let round = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
        let (kc, vc, heads) = (round(&kc), round(&vc), round(&heads));
        let want: Vec<Tensor> = rows
            .iter()
            .enumerate()
            .map(|(i, &(s, p))| {
                row_attention(&heads.get(i).unwrap(), &kc, &vc, s as usize, p as usize)
            })
            .collect();
        let want = Tensor::stack(&want, 0).unwrap();
        let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
        let slots: Vec<u32> = rows.iter().map(|r| r.0).collect();
        let pos: Vec<u32> = rows.iter().map(|r| r.1).collect();
        let slots = Tensor::new(slots.as_slice(), &dev).unwrap();
        let pos = Tensor::new(pos.as_slice(), &dev).unwrap();
        let tol = if dtype == DType::F32 { 1e-4 } else { 2e-2 };
        // a ragged step's split (`max_pos` known), and a graph's (the whole capacity)
        for (what, m) in [("prompt chunk", Some(max_pos)), ("graph", None)] {
            let got =
                decode_attention_batch(&on(&heads), hq, hkv, &on(&kc), &on(&vc), &slots, &pos, m)
                    .unwrap();
            let what = format!("{cap}, {hq}/{hkv}x{d}, teams {teams}: {dtype:?} {what}");
            assert_close(&what, &got, &want, tol);
        }
        // a lone row at the slot's end: its positions in spans of one chunk each (the kernel's
        // split count follows the batch: 43 rows take spans of several chunks above)
        let last = |t: &Tensor| t.narrow(0, b - 1, 1).unwrap();
        let got = decode_attention_batch(
            &last(&on(&heads)),
            hq,
            hkv,
            &on(&kc),
            &on(&vc),
            &last(&slots),
            &last(&pos),
            None,
        )
        .unwrap();
        let what = format!("{cap}, {hq}/{hkv}x{d}, teams {teams}: {dtype:?} lone row");
        assert_close(&what, &got, &last(&want), tol);
    }
}

/// The causal softmax (on CUDA one kernel that never makes the mask) against the mask added and
/// the softmax taken, on the host in f32: rows of several queries late in a long row, and a lone
/// query; every position a query must not see gets 0, each row sums to 1.
#[test]
fn the_causal_softmax_matches_the_mask_and_the_softmax() {
    use antiphon_models::fused::{causal_softmax, causal_softmax_twin};
    let dev = common::device();
    let host = Device::Cpu;
    for (lead, n, l) in [(3, 5, 40), (2, 96, 1100), (4, 1, 700)] {
        let att = Tensor::randn(0f32, 2.0, (lead, 4 * n, l), &host).unwrap();
        // (bf16 where a kernel takes it; the CPU's own bf16 softmax rounds as it goes)
        let dtypes = if dev.is_cpu() { vec![DType::F32] } else { vec![DType::F32, DType::BF16] };
        for dtype in dtypes {
            let att = att.to_dtype(dtype).unwrap();
            let want = causal_softmax_twin(&att.to_dtype(DType::F32).unwrap(), n).unwrap();
            let got = causal_softmax(&att.to_device(&dev).unwrap(), n).unwrap();
            let got = got.to_device(&host).unwrap().to_dtype(DType::F32).unwrap();
            let tol = if dtype == DType::F32 { 1e-4 } else { 2e-2 };
            assert_close(&format!("({lead}, {n}, {l}) {dtype:?}"), &got, &want, tol);
            let rows = got.to_vec3::<f32>().unwrap();
            for (r, row) in rows.iter().flatten().enumerate() {
                let last = l - n + r % n;
                assert!(row[last + 1..].iter().all(|&p| p == 0.0), "row {r} sees past {last}");
                let sum: f32 = row.iter().sum();
                assert!((sum - 1.0).abs() < 1e-2, "row {r} sums to {sum}");
            }
        }
    }
}
