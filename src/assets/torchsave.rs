//! Writes a state dict in torch's zip format (what `torch.save(model.state_dict(), path)` writes):
//! a zip archive holding `<name>/data.pkl` (a protocol-2 pickle of an `OrderedDict` whose values
//! are `torch._utils._rebuild_tensor_v2` calls over persistent storage ids), one raw little-endian
//! file per storage under `<name>/data/`, `<name>/byteorder` and `<name>/version`. candle's reader
//! and `torch.load(weights_only=True)` both read it. Used for the synthetic `flow.pt` / `hift.pt`.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};

struct Pickle(Vec<u8>);

impl Pickle {
    fn op(&mut self, b: u8) {
        self.0.push(b);
    }
    fn global(&mut self, module: &str, name: &str) {
        self.op(b'c');
        self.0.extend_from_slice(module.as_bytes());
        self.0.push(b'\n');
        self.0.extend_from_slice(name.as_bytes());
        self.0.push(b'\n');
    }
    fn string(&mut self, s: &str) {
        self.op(b'X');
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn int(&mut self, v: usize) {
        if v < 256 {
            self.op(b'K');
            self.0.push(v as u8);
        } else if v < 65536 {
            self.op(b'M');
            self.0.extend_from_slice(&(v as u16).to_le_bytes());
        } else if v <= i32::MAX as usize {
            self.op(b'J');
            self.0.extend_from_slice(&(v as i32).to_le_bytes());
        } else {
            // LONG1 for values beyond 31 bits
            self.op(0x8a);
            let bytes = (v as u64).to_le_bytes();
            let mut n = 8;
            while n > 1 && bytes[n - 1] == 0 && bytes[n - 2] & 0x80 == 0 {
                n -= 1;
            }
            self.0.push(n as u8);
            self.0.extend_from_slice(&bytes[..n]);
        }
    }
    fn int_tuple(&mut self, v: &[usize]) {
        self.op(b'(');
        for &x in v {
            self.int(x);
        }
        self.op(b't');
    }
}

/// Writes `tensors` (in the given order) as a torch zip state dict named `archive`.
pub fn save_state_dict(path: &Path, archive: &str, tensors: &[(String, Tensor)]) -> Result<()> {
    let mut p = Pickle(Vec::new());
    p.op(0x80);
    p.op(2);
    p.global("collections", "OrderedDict");
    p.op(b')');
    p.op(b'R');
    p.op(b'(');
    let mut storages: Vec<Vec<u8>> = Vec::new();
    for (key, t) in tensors {
        let (storage, bytes) = match t.dtype() {
            DType::F32 => (
                "FloatStorage",
                t.flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>(),
            ),
            DType::BF16 => (
                "BFloat16Storage",
                t.flatten_all()?
                    .to_vec1::<half::bf16>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            DType::F16 => (
                "HalfStorage",
                t.flatten_all()?
                    .to_vec1::<half::f16>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            DType::F64 => (
                "DoubleStorage",
                t.flatten_all()?.to_vec1::<f64>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
            other => bail!("{key}: dtype {other:?} is not written"),
        };
        let dims = t.dims().to_vec();
        let mut stride = vec![1usize; dims.len()];
        for i in (0..dims.len().saturating_sub(1)).rev() {
            stride[i] = stride[i + 1] * dims[i + 1];
        }
        p.string(key);
        p.global("torch._utils", "_rebuild_tensor_v2");
        p.op(b'(');
        // persistent id: ('storage', torch.<Type>Storage, key, 'cpu', numel)
        p.op(b'(');
        p.string("storage");
        p.global("torch", storage);
        p.string(&storages.len().to_string());
        p.string("cpu");
        p.int(t.elem_count());
        p.op(b't');
        p.op(b'Q');
        p.int(0);
        p.int_tuple(&dims);
        p.int_tuple(&stride);
        p.op(0x89); // False: requires_grad
        p.global("collections", "OrderedDict");
        p.op(b')');
        p.op(b'R');
        p.op(b't');
        p.op(b'R');
        storages.push(bytes);
    }
    p.op(b'u');
    p.op(b'.');

    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut z = zip::ZipWriter::new(file);
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .with_alignment(64);
    z.start_file(format!("{archive}/data.pkl"), opts)?;
    z.write_all(&p.0)?;
    z.start_file(format!("{archive}/byteorder"), opts)?;
    z.write_all(b"little")?;
    for (i, s) in storages.iter().enumerate() {
        z.start_file(format!("{archive}/data/{i}"), opts)?;
        z.write_all(s)?;
    }
    z.start_file(format!("{archive}/version"), opts)?;
    z.write_all(b"3\n")?;
    z.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn candle_reads_what_we_write() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.pt");
        let a = Tensor::arange(0f32, 24.0, &Device::Cpu).unwrap().reshape((2, 3, 4)).unwrap();
        let b = Tensor::new(&[1.5f32, -2.0], &Device::Cpu).unwrap();
        let big = Tensor::zeros(70_000, DType::F32, &Device::Cpu).unwrap();
        save_state_dict(
            &p,
            "x",
            &[("a.weight".into(), a.clone()), ("b".into(), b.clone()), ("big".into(), big)],
        )
        .unwrap();
        let back: std::collections::HashMap<String, Tensor> =
            candle_core::pickle::read_all(&p).unwrap().into_iter().collect();
        assert_eq!(back["a.weight"].to_vec3::<f32>().unwrap(), a.to_vec3::<f32>().unwrap());
        assert_eq!(back["b"].to_vec1::<f32>().unwrap(), vec![1.5, -2.0]);
        assert_eq!(back["big"].dims(), &[70_000]);
    }
}
