//! A synthetic CAM++ (the speaker embedding) as an ONNX graph in the operator vocabulary of
//! torch's exports, at the real widths or tiny ones.

use anyhow::Result;
use candle_core::{Device, Tensor};

use crate::onnx::{attr_float, attr_int, attr_ints, dtype, GraphBuilder, ModelProto};

/// CAM++ widths (3D-Speaker's `CAMPPlus`; the real model: FCM 32 channels, 128 initial channels,
/// growth 32, bottleneck 128, dense blocks of 12 / 24 / 16 layers, 192-d embedding).
#[derive(Debug, Clone, PartialEq)]
pub struct CamConfig {
    pub feat_dim: usize,
    pub m_channels: usize,
    pub init_channels: usize,
    pub growth: usize,
    pub bn_channels: usize,
    pub layers: [usize; 3],
    pub dilations: [usize; 3],
    pub embedding: usize,
}

impl CamConfig {
    pub fn real() -> Self {
        Self {
            feat_dim: 80,
            m_channels: 32,
            init_channels: 128,
            growth: 32,
            bn_channels: 128,
            layers: [12, 24, 16],
            dilations: [1, 2, 2],
            embedding: 192,
        }
    }

    pub fn tiny() -> Self {
        Self {
            feat_dim: 80,
            m_channels: 8,
            init_channels: 16,
            growth: 8,
            bn_channels: 16,
            layers: [2, 2, 2],
            dilations: [1, 2, 2],
            embedding: 192,
        }
    }
}

/// Builds a CAM++ graph in the operator vocabulary of torch's exports (convolutions with batch
/// norms folded in where a norm directly follows, standalone batch norms where one precedes a
/// convolution, segment pooling through AveragePool / Expand / Reshape / Slice, statistics pooling
/// through reductions). `weight(name, shape)` supplies every parameter; batch-norm statistics use
/// the `.running_mean` / `.running_var` names.
pub fn build_graph(
    cfg: &CamConfig,
    weight: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
) -> Result<ModelProto> {
    let mut g = GraphBuilder::new("campplus");
    let c_i64 = |g: &mut GraphBuilder, name: &str, v: &[i64]| -> Result<String> {
        let n = v.len();
        g.init(name, &Tensor::from_vec(v.to_vec(), n, &Device::Cpu)?)
    };
    g.input("input", &[Some(1), None, Some(cfg.feat_dim as i64)]);
    let mut x = g.node("Transpose", "/Transpose", &["input"], vec![attr_ints("perm", &[0, 2, 1])]);
    let ax1 = c_i64(&mut g, "axes_1", &[1])?;
    x = g.node("Unsqueeze", "/head/Unsqueeze", &[&x, &ax1], vec![]);
    // a conv with a folded batch norm (bias), optionally followed by ReLU
    #[allow(clippy::too_many_arguments)]
    fn conv(
        g: &mut GraphBuilder,
        weight: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
        x: &str,
        name: &str,
        shape: &[usize],
        stride: &[i64],
        pad: i64,
        dil: i64,
        bias: bool,
    ) -> Result<String> {
        let w = g.init(&format!("{name}.weight"), &weight(&format!("{name}.weight"), shape)?)?;
        let mut inputs = vec![x.to_string(), w];
        if bias {
            inputs.push(
                g.init(&format!("{name}.bias"), &weight(&format!("{name}.bias"), &[shape[0]])?)?,
            );
        }
        let spatial = shape.len() - 2;
        let k: Vec<i64> = shape[2..].iter().map(|&v| v as i64).collect();
        let refs: Vec<&str> = inputs.iter().map(|s| s.as_str()).collect();
        Ok(g.node(
            "Conv",
            &format!("/{name}/Conv"),
            &refs,
            vec![
                attr_ints("kernel_shape", &k),
                attr_ints("strides", stride),
                attr_ints("pads", &vec![pad; 2 * spatial]),
                attr_ints("dilations", &vec![dil; spatial]),
                attr_int("group", 1),
            ],
        ))
    }
    let relu = |g: &mut GraphBuilder, x: &str, name: &str| {
        g.node("Relu", &format!("/{name}/Relu"), &[x], vec![])
    };
    let m = cfg.m_channels;
    // FCM head: conv, two stages of two residual blocks (the first strides by 2 over frequency),
    // conv
    x = conv(&mut g, weight, &x, "head.conv1", &[m, 1, 3, 3], &[1, 1], 1, 1, true)?;
    x = relu(&mut g, &x, "head.conv1");
    for layer in 1..=2 {
        for blk in 0..2 {
            let p = format!("head.layer{layer}.{blk}");
            let s = if blk == 0 { 2 } else { 1 };
            let h = conv(
                &mut g,
                weight,
                &x,
                &format!("{p}.conv1"),
                &[m, m, 3, 3],
                &[s, 1],
                1,
                1,
                true,
            )?;
            let h = relu(&mut g, &h, &format!("{p}.conv1"));
            let h = conv(
                &mut g,
                weight,
                &h,
                &format!("{p}.conv2"),
                &[m, m, 3, 3],
                &[1, 1],
                1,
                1,
                true,
            )?;
            let sc = if s != 1 {
                conv(
                    &mut g,
                    weight,
                    &x,
                    &format!("{p}.shortcut.0"),
                    &[m, m, 1, 1],
                    &[s, 1],
                    0,
                    1,
                    true,
                )?
            } else {
                x.clone()
            };
            let sum = g.node("Add", &format!("/{p}/Add"), &[&h, &sc], vec![]);
            x = relu(&mut g, &sum, &p);
        }
    }
    x = conv(&mut g, weight, &x, "head.conv2", &[m, m, 3, 3], &[2, 1], 1, 1, true)?;
    x = relu(&mut g, &x, "head.conv2");
    let c0 = m * (cfg.feat_dim / 8);
    let shape = c_i64(&mut g, "head_shape", &[0, c0 as i64, -1])?;
    x = g.node("Reshape", "/head/Reshape", &[&x, &shape], vec![]);
    // TDNN
    x = conv(
        &mut g,
        weight,
        &x,
        "xvector.tdnn.linear",
        &[cfg.init_channels, c0, 5],
        &[2],
        2,
        1,
        true,
    )?;
    x = relu(&mut g, &x, "xvector.tdnn");
    let ax2 = c_i64(&mut g, "axes_2", &[2])?;
    let ax3 = c_i64(&mut g, "axes_3", &[3])?;
    let zero = c_i64(&mut g, "zero", &[0])?;
    let three = c_i64(&mut g, "three", &[3])?;
    let hundred = c_i64(&mut g, "seg_len", &[100])?;
    let flat = c_i64(&mut g, "seg_flat", &[0, 0, -1])?;
    let idx2 = g.init("index_2", &Tensor::new(2i64, &Device::Cpu)?)?;
    fn bn(
        g: &mut GraphBuilder,
        weight: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
        x: &str,
        name: &str,
        c: usize,
    ) -> Result<String> {
        let s = g.init(&format!("{name}.weight"), &weight(&format!("{name}.weight"), &[c])?)?;
        let b = g.init(&format!("{name}.bias"), &weight(&format!("{name}.bias"), &[c])?)?;
        let rm = g.init(
            &format!("{name}.running_mean"),
            &weight(&format!("{name}.running_mean"), &[c])?,
        )?;
        let rv =
            g.init(&format!("{name}.running_var"), &weight(&format!("{name}.running_var"), &[c])?)?;
        Ok(g.node(
            "BatchNormalization",
            &format!("/{name}/BatchNormalization"),
            &[x, &s, &b, &rm, &rv],
            vec![attr_float("epsilon", 1e-5)],
        ))
    }
    let mut ch = cfg.init_channels;
    for (bi, (&nl, &dil)) in cfg.layers.iter().zip(&cfg.dilations).enumerate() {
        for li in 0..nl {
            let p = format!("xvector.block{}.tdnnd{}", bi + 1, li + 1);
            let h = bn(&mut g, weight, &x, &format!("{p}.nonlinear1.batchnorm"), ch)?;
            let h = relu(&mut g, &h, &format!("{p}.nonlinear1"));
            let h = conv(
                &mut g,
                weight,
                &h,
                &format!("{p}.linear1"),
                &[cfg.bn_channels, ch, 1],
                &[1],
                0,
                1,
                true,
            )?;
            let h = relu(&mut g, &h, &format!("{p}.nonlinear2"));
            let y = conv(
                &mut g,
                weight,
                &h,
                &format!("{p}.cam_layer.linear_local"),
                &[cfg.growth, cfg.bn_channels, 3],
                &[1],
                dil as i64,
                dil as i64,
                false,
            )?;
            // context: global mean + segment means (100 frames, last segment partial)
            let mean = g.node(
                "ReduceMean",
                &format!("/{p}/cam_layer/ReduceMean"),
                &[&h],
                vec![attr_ints("axes", &[2]), attr_int("keepdims", 1)],
            );
            let seg = g.node(
                "AveragePool",
                &format!("/{p}/cam_layer/AveragePool"),
                &[&h],
                vec![
                    attr_ints("kernel_shape", &[100]),
                    attr_ints("strides", &[100]),
                    attr_int("ceil_mode", 1),
                ],
            );
            let seg =
                g.node("Unsqueeze", &format!("/{p}/cam_layer/Unsqueeze"), &[&seg, &ax3], vec![]);
            let sshape = g.node("Shape", &format!("/{p}/cam_layer/Shape"), &[&seg], vec![]);
            let sshape = g.node(
                "Slice",
                &format!("/{p}/cam_layer/Slice"),
                &[&sshape, &zero, &three],
                vec![],
            );
            let eshape = g.node(
                "Concat",
                &format!("/{p}/cam_layer/Concat"),
                &[&sshape, &hundred],
                vec![attr_int("axis", 0)],
            );
            let seg = g.node("Expand", &format!("/{p}/cam_layer/Expand"), &[&seg, &eshape], vec![]);
            let seg = g.node("Reshape", &format!("/{p}/cam_layer/Reshape"), &[&seg, &flat], vec![]);
            let hshape = g.node("Shape", &format!("/{p}/cam_layer/Shape_1"), &[&h], vec![]);
            let t = g.node(
                "Gather",
                &format!("/{p}/cam_layer/Gather"),
                &[&hshape, &idx2],
                vec![attr_int("axis", 0)],
            );
            let t =
                g.node("Unsqueeze", &format!("/{p}/cam_layer/Unsqueeze_1"), &[&t, &zero], vec![]);
            let seg = g.node(
                "Slice",
                &format!("/{p}/cam_layer/Slice_1"),
                &[&seg, &zero, &t, &ax2],
                vec![],
            );
            let ctx = g.node("Add", &format!("/{p}/cam_layer/Add"), &[&mean, &seg], vec![]);
            let c = conv(
                &mut g,
                weight,
                &ctx,
                &format!("{p}.cam_layer.linear1"),
                &[cfg.bn_channels / 2, cfg.bn_channels, 1],
                &[1],
                0,
                1,
                true,
            )?;
            let c = relu(&mut g, &c, &format!("{p}.cam_layer"));
            let c = conv(
                &mut g,
                weight,
                &c,
                &format!("{p}.cam_layer.linear2"),
                &[cfg.growth, cfg.bn_channels / 2, 1],
                &[1],
                0,
                1,
                true,
            )?;
            let mk = g.node("Sigmoid", &format!("/{p}/cam_layer/Sigmoid"), &[&c], vec![]);
            let out = g.node("Mul", &format!("/{p}/cam_layer/Mul"), &[&y, &mk], vec![]);
            x = g.node("Concat", &format!("/{p}/Concat"), &[&x, &out], vec![attr_int("axis", 1)]);
            ch += cfg.growth;
        }
        let p = format!("xvector.transit{}", bi + 1);
        let h = bn(&mut g, weight, &x, &format!("{p}.nonlinear.batchnorm"), ch)?;
        let h = relu(&mut g, &h, &format!("{p}.nonlinear"));
        x = conv(&mut g, weight, &h, &format!("{p}.linear"), &[ch / 2, ch, 1], &[1], 0, 1, false)?;
        ch /= 2;
    }
    x = bn(&mut g, weight, &x, "xvector.out_nonlinear.batchnorm", ch)?;
    x = relu(&mut g, &x, "xvector.out_nonlinear");
    // statistics pooling: mean and unbiased standard deviation over time
    let mean = g.node(
        "ReduceMean",
        "/xvector/stats/ReduceMean",
        &[&x],
        vec![attr_ints("axes", &[2]), attr_int("keepdims", 1)],
    );
    let cen = g.node("Sub", "/xvector/stats/Sub", &[&x, &mean], vec![]);
    let sq = g.node("Mul", "/xvector/stats/Mul", &[&cen, &cen], vec![]);
    let ss = g.node(
        "ReduceSum",
        "/xvector/stats/ReduceSum",
        &[&sq, &ax2],
        vec![attr_int("keepdims", 0)],
    );
    let xs = g.node("Shape", "/xvector/stats/Shape", &[&x], vec![]);
    let t = g.node("Gather", "/xvector/stats/Gather", &[&xs, &idx2], vec![attr_int("axis", 0)]);
    let t = g.node("Cast", "/xvector/stats/Cast", &[&t], vec![attr_int("to", dtype::FLOAT as i64)]);
    let one = g.init("one_f", &Tensor::new(1f32, &Device::Cpu)?)?;
    let tm1 = g.node("Sub", "/xvector/stats/Sub_1", &[&t, &one], vec![]);
    let var = g.node("Div", "/xvector/stats/Div", &[&ss, &tm1], vec![]);
    let std = g.node("Sqrt", "/xvector/stats/Sqrt", &[&var], vec![]);
    let mean2 = g.node("Squeeze", "/xvector/stats/Squeeze", &[&mean, &ax2], vec![]);
    let stats =
        g.node("Concat", "/xvector/stats/Concat", &[&mean2, &std], vec![attr_int("axis", 1)]);
    let stats = g.node("Unsqueeze", "/xvector/dense/Unsqueeze", &[&stats, &ax2], vec![]);
    let emb = conv(
        &mut g,
        weight,
        &stats,
        "xvector.dense.linear",
        &[cfg.embedding, 2 * ch, 1],
        &[1],
        0,
        1,
        true,
    )?;
    let out = g.node("Squeeze", "/xvector/dense/Squeeze", &[&emb, &ax2], vec![]);
    g.output(&out, &[Some(1), Some(cfg.embedding as i64)]);
    Ok(g.finish(13))
}
