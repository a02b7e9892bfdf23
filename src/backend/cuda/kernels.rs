//! Compiling lily's CUDA kernels with NVRTC, for sm_90a, at start-up.
//!
//! Every `.cu` module is compiled with `common.cuh` and `rowdot.cuh` prepended. The PTX is cached
//! on disk (`$LILY_CACHE_DIR`, else `$XDG_CACHE_HOME/lily`, else `~/.cache/lily`) under a hash of
//! the source and options, so a second start skips compilation. Headers come from
//! `CUDA_INCLUDE_DIR`, `$CUDA_PATH/include` or `/usr/local/cuda/include`.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use cudarc::nvrtc::{CompileOptions, Ptx};
use rayon::prelude::*;

use super::weights::WeightFormat;
use crate::config::ModelConfig;

/// The architecture every kernel is compiled for (Hopper with its `a` features).
pub const ARCH: &str = "sm_90a";

const PRELUDE: &[&str] = &[
    include_str!("kernels/common.cuh"),
    include_str!("kernels/rowdot.cuh"),
];

/// Kernel modules: (name, source).
pub const MODULES: &[(&str, &str)] = &[
    ("matvec", include_str!("kernels/matvec.cu")),
    ("deltanet", include_str!("kernels/deltanet.cu")),
    ("attention", include_str!("kernels/attention.cu")),
    ("moe", include_str!("kernels/moe.cu")),
    ("sample", include_str!("kernels/sample.cu")),
    ("fill", include_str!("kernels/fill.cu")),
    ("gemm", include_str!("kernels/gemm.cu")),
];

/// Full-size models of the family whose shapes `check_all` compiles into the modules that take
/// them: the one lily is built for, and the largest (twice its hidden size, twice the value
/// heads per key head, 512 experts of which 10 are active, 1,024 intermediates).
const FULL_SIZE_CONFIGS: &[(&str, &str)] = &[
    (
        "Qwen3.6-35B-A3B",
        include_str!("../../../configs/qwen3.6-35b-a3b.json"),
    ),
    (
        "Qwen3.5-397B-A17B",
        include_str!("../../../configs/qwen3.5-397b-a17b.json"),
    ),
];

/// The `extern "C"` kernels of each module that the backend loads.
pub fn kernel_names(module: &str) -> &'static [&'static str] {
    match module {
        "matvec" => &[
            "matvec",
            "matvec_two_rows",
            "matvec_tokens",
            "matvec_two_rows_tokens",
            "matvec_mma",
            "matvec_mma_16",
            "matvec_mma_32",
            "embed",
        ],
        "deltanet" => &[
            "deltanet_step",
            "deltanet_step_batched",
            "deltanet_conv_ring",
            "deltanet_conv_chunk",
            "deltanet_norm_chunk",
            "deltanet_scan",
            "deltanet_chunk_prepare",
            "deltanet_chunk_state",
            "deltanet_chunk_output",
            "deltanet_gated_norm",
        ],
        "attention" => &[
            "attention_prepare",
            "attention_split",
            "attention_split_shared",
            "attention_combine",
            "attention_prefill",
        ],
        "moe" => &[
            "moe_router_shared",
            "fold_router",
            "fold_to_half",
            "out_proj_route",
            "moe_gate_up",
            "moe_down",
            "moe_down_batched",
            "moe_gate_up_tokens",
            "moe_route",
            "moe_group",
        ],
        "sample" => &[
            "argmax_partial",
            "argmax_final",
            "sample_scan",
            "sample_finish",
            "advance_position",
        ],
        "fill" => &["fill_bf16", "fill_u32"],
        "gemm" => &[
            "rows_to_half",
            "gemm_q",
            "gemm_q_grouped",
            "gemm_q_grouped_wide",
            "swiglu_to_half",
            "add_expert_rows",
            "wgmma_peak",
        ],
        _ => &[],
    }
}

/// Where the CUDA headers NVRTC needs are found.
pub fn include_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CUDA_INCLUDE_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(root) = std::env::var_os("CUDA_PATH") {
        return PathBuf::from(root).join("include");
    }
    PathBuf::from("/usr/local/cuda/include")
}

/// Where compiled modules are cached (`None`: nowhere to cache, every start compiles).
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("LILY_CACHE_DIR") {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("lily"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/lily"))
}

fn options(defines: &[String]) -> CompileOptions {
    let mut options = vec!["--std=c++17".to_string(), "-lineinfo".to_string()];
    options.extend(defines.iter().map(|d| format!("-D{d}")));
    CompileOptions {
        arch: Some(ARCH),
        include_paths: vec![include_dir().display().to_string()],
        options,
        use_fast_math: Some(false),
        ..Default::default()
    }
}

/// The full source of module `name`: the prelude, then the module.
fn full_source(src: &str) -> String {
    let mut s = PRELUDE.join("\n");
    s.push('\n');
    s.push_str(src);
    s
}

/// The kernels a compiled module's `ptx` defines (its `.entry` names).
fn defined_kernels(ptx: &str) -> impl Iterator<Item = &str> {
    ptx.split(".entry ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
}

/// The kernels of module `name` the backend loads that its compiled `ptx` does not define.
fn missing_kernels(name: &str, ptx: &str) -> Vec<&'static str> {
    kernel_names(name)
        .iter()
        .copied()
        .filter(|k| !defined_kernels(ptx).any(|d| d == *k))
        .collect()
}

/// The kernels module `name`'s compiled `ptx` defines that the backend does not load (a kernel
/// added to a `.cu` file but not to `kernel_names` would fail only when first launched).
fn unlisted_kernels<'p>(name: &str, ptx: &'p str) -> Vec<&'p str> {
    defined_kernels(ptx)
        .filter(|k| !kernel_names(name).contains(k))
        .collect()
}

/// Fails, naming what is missing, where NVRTC cannot be loaded (cudarc would panic).
fn require_nvrtc() -> Result<()> {
    // SAFETY: only opens (and closes) the shared library by its possible names.
    ensure!(
        unsafe { cudarc::nvrtc::sys::is_culib_present() },
        "NVRTC (libnvrtc.so), which compiles lily's CUDA kernels, is not on the library path: \
         install the CUDA toolkit or `pip install nvidia-cuda-nvrtc`, and add its lib folder to \
         LD_LIBRARY_PATH"
    );
    Ok(())
}

/// Compiles one module (or takes it from the cache), with `defines` (`NAME=VALUE`) set.
pub fn compile(name: &str, src: &str, use_cache: bool, defines: &[String]) -> Result<Ptx> {
    let source = full_source(src);
    let opts = options(defines);
    let mut hasher = DefaultHasher::new();
    source.hash(&mut hasher);
    format!("{opts:?}").hash(&mut hasher);
    let cached = cache_dir().map(|d| d.join(format!("{name}-{:016x}.ptx", hasher.finish())));
    if use_cache
        && let Some(path) = &cached
        && let Ok(ptx) = std::fs::read_to_string(path)
    {
        return Ok(Ptx::from_src(ptx));
    }
    require_nvrtc()?;
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&source, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            anyhow::anyhow!(
                "kernel module `{name}` failed to compile:\n{}",
                log.to_string_lossy()
            )
        }
        other => anyhow::anyhow!(
            "kernel module `{name}`: NVRTC failed ({other:?}); is libnvrtc on the library path and \
             are the CUDA headers in {}?",
            include_dir().display()
        ),
    })?;
    if let Some(path) = &cached {
        // A cache that cannot be written only costs the next start a compilation.
        let _ = write_atomically(path, &ptx.to_src());
    }
    Ok(ptx)
}

/// Writes `text` to a file of its own beside `path`, then renames it over `path`: processes
/// starting side by side never read a half-written cache entry.
fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(path);
    std::fs::create_dir_all(dir)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Extra defines for experiments (`NAME=VALUE`, space-separated in `LILY_DEFINES`): they set the
/// kernels' #ifndef-guarded constants, so that one binary measures several variants.
pub fn experiment_defines() -> Vec<String> {
    std::env::var("LILY_DEFINES")
        .unwrap_or_default()
        .split_whitespace()
        .map(String::from)
        .collect()
}

/// `lily kernels --check`: compiles every module without the cache; reports and fails on errors.
/// The shape-specialised modules are compiled for the family's full-size models and for
/// `configs` (name, config). With `ptx_dir`, each module's PTX is also written there, named
/// `module_variant.ptx` (`ptx_file_name`).
pub fn check_all(configs: &[(String, ModelConfig)], ptx_dir: Option<&Path>) -> Result<()> {
    require_nvrtc()?;
    let mut failed = Vec::new();
    // Every module as loaded (scales and biases in bf16, and in fp16), and with the block
    // records of `lily bench --trace` compiled in (at a made-up address: nothing runs); each
    // with the experiments' defines, as the backend loads them.
    let with = |extra: &[&str]| {
        let mut d: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        d.extend(experiment_defines());
        d
    };
    let variants = [
        (with(&[]), ""),
        (with(&["LILY_SCALES_F16"]), " (fp16 scales)"),
        (
            with(&["LILY_TRACE_BUF=0x10000ull", "LILY_TRACE_CAP=1"]),
            " (traced)",
        ),
    ];
    let mut jobs: Vec<_> = variants
        .iter()
        .flat_map(|(defines, variant)| {
            MODULES
                .iter()
                .map(move |m| (defines.clone(), variant.to_string(), m))
        })
        .collect();
    // And with the shapes of full-size models of the family (and of `configs`) compiled in, as
    // the backend compiles them for each, for experts of every format (each module once per
    // distinct set of defines).
    let mut models = FULL_SIZE_CONFIGS
        .iter()
        .map(|(model, json)| {
            let config = ModelConfig::from_json_str(json)
                .with_context(|| format!("the configuration of {model}"))?;
            Ok((model.to_string(), config))
        })
        .collect::<Result<Vec<_>>>()?;
    models.extend(configs.iter().cloned());
    let mut shaped: Vec<(&str, Vec<String>)> = Vec::new();
    for (model, config) in &models {
        for experts in [
            WeightFormat::Affine { bits: 4, group: 64 },
            WeightFormat::Affine { bits: 8, group: 32 },
            WeightFormat::Bf16,
        ] {
            for (module, own) in super::shapes::shape_defines(config, Some(experts)) {
                if shaped.contains(&(module, own.clone())) {
                    continue;
                }
                shaped.push((module, own.clone()));
                let m = MODULES
                    .iter()
                    .find(|(name, _)| *name == module)
                    .with_context(|| format!("no kernel module `{module}`"))?;
                let variant = format!(" ({model} shape, experts {experts:?})");
                jobs.push(([with(&[]), own].concat(), variant, m));
            }
        }
    }
    // In parallel (NVRTC compiles separate programs concurrently), reported in order.
    let results: Vec<_> = jobs
        .par_iter()
        .map(|(defines, _, (name, src))| {
            let start = Instant::now();
            (compile(name, src, false, defines), start.elapsed())
        })
        .collect();
    // Through a lock rather than `println!`, so that a closed pipe is an error, not a panic.
    let mut out = std::io::stdout().lock();
    for ((_, variant, (name, _)), (result, took)) in jobs.iter().zip(results) {
        let result = result.and_then(|ptx| {
            let src = ptx.to_src();
            let missing = missing_kernels(name, &src);
            ensure!(
                missing.is_empty(),
                "kernels the backend loads are not defined: {}",
                missing.join(", ")
            );
            let unlisted = unlisted_kernels(name, &src);
            ensure!(
                unlisted.is_empty(),
                "kernels defined but not in kernel_names (so never loaded): {}",
                unlisted.join(", ")
            );
            if let Some(dir) = ptx_dir {
                let path = dir.join(ptx_file_name(name, variant));
                std::fs::create_dir_all(dir)
                    .and_then(|()| std::fs::write(&path, src))
                    .with_context(|| format!("cannot write {}", path.display()))?;
            }
            Ok(())
        });
        match result {
            Ok(()) => writeln!(out, "ok     {name}{variant} ({:.2} s)", took.as_secs_f64())?,
            Err(e) => {
                writeln!(out, "FAILED {name}{variant}\n{e:#}")?;
                failed.push(format!("{name}{variant}"));
            }
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} kernel module(s) failed: {}",
            failed.len(),
            failed.join(", ")
        );
    }
    writeln!(
        out,
        "all {} kernel modules compiled for {ARCH}",
        MODULES.len()
    )?;
    Ok(())
}

/// `module_variant.ptx` for a module and its variant's description (` (fp16 scales)`, ` (Qwen3.6-35B-A3B
/// shape, experts Bf16)`), everything but letters, digits, `.` and `-` made `_` and runs of them
/// one.
fn ptx_file_name(module: &str, variant: &str) -> String {
    let mut name = String::new();
    for c in format!("{module} {variant}").chars() {
        if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
            name.push(c);
        } else if !name.ends_with('_') {
            name.push('_');
        }
    }
    format!("{}.ptx", name.trim_end_matches('_'))
}

/// Defines of one module only (the model's shapes it is compiled for): (module, defines).
pub type ModuleDefines<'a> = [(&'a str, Vec<String>)];

/// `defines`, then those `per_module` gives module `name`.
fn module_defines(name: &str, defines: &[String], per_module: &ModuleDefines) -> Vec<String> {
    let own = per_module.iter().filter(|(m, _)| *m == name);
    defines
        .iter()
        .chain(own.flat_map(|(_, d)| d))
        .cloned()
        .collect()
}

/// Compiles every module with `defines` (and its own in `per_module`) set, for loading into a
/// context. The modules compile in parallel: a start with nothing cached waits for the slowest
/// one rather than for all in turn.
pub fn compile_all(
    defines: &[String],
    per_module: &ModuleDefines,
) -> Result<Vec<(&'static str, Ptx)>> {
    MODULES
        .par_iter()
        .map(|(name, src)| {
            let defines = module_defines(name, defines, per_module);
            Ok((
                *name,
                compile(name, src, true, &defines).context("compiling kernels")?,
            ))
        })
        .collect()
}

/// Compiles module `name` again, bypassing and then replacing its cache entry: for a cached PTX
/// file the driver would not load (damaged on disk, or from another toolchain).
pub fn recompile(name: &str, defines: &[String], per_module: &ModuleDefines) -> Result<Ptx> {
    let (_, src) = MODULES
        .iter()
        .find(|(n, _)| *n == name)
        .with_context(|| format!("no kernel module `{name}`"))?;
    compile(name, src, false, &module_defines(name, defines, per_module))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_files_are_named_by_module_and_variant() {
        assert_eq!(ptx_file_name("moe", ""), "moe.ptx");
        assert_eq!(
            ptx_file_name("moe", " (fp16 scales)"),
            "moe_fp16_scales.ptx"
        );
        assert_eq!(
            ptx_file_name(
                "moe",
                " (Qwen3.6-35B-A3B shape, experts Affine { bits: 8, group: 32 })"
            ),
            "moe_Qwen3.6-35B-A3B_shape_experts_Affine_bits_8_group_32.ptx"
        );
        assert_eq!(
            ptx_file_name(
                "deltanet",
                " (tests/data/layouts/top1-tied.json shape, experts Bf16)"
            ),
            "deltanet_tests_data_layouts_top1-tied.json_shape_experts_Bf16.ptx"
        );
    }

    #[test]
    fn kernels_the_backend_loads_must_be_in_the_module() {
        let ptx = ".visible .entry attention_prepare(\n.visible .entry attention_split(\n\
                   .visible .entry attention_split_shared(\n.visible .entry attention_prefill(";
        assert_eq!(missing_kernels("attention", ptx), vec!["attention_combine"]);
        assert!(missing_kernels("fill", ".entry fill_bf16(\n.entry fill_u32(").is_empty());
        assert_eq!(
            missing_kernels("fill", ".entry fill_bf16_x("),
            vec!["fill_bf16", "fill_u32"]
        );
    }

    #[test]
    fn kernels_a_module_defines_must_be_ones_the_backend_loads() {
        let ptx = ".visible .entry fill_bf16(\n.param .u64 a\n)\n.visible .entry fill_u32(";
        assert!(unlisted_kernels("fill", ptx).is_empty());
        let ptx = ".visible .entry moe_down(\n.visible .entry moe_down_pairs(";
        assert_eq!(unlisted_kernels("moe", ptx), vec!["moe_down_pairs"]);
    }

    #[test]
    fn cache_entries_are_replaced_whole_and_leave_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("module-0123.ptx");
        write_atomically(&path, "first").unwrap();
        write_atomically(&path, "second, longer than the first").unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "second, longer than the first"
        );
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("module-0123.ptx")]);
    }
}
