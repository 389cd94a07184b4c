//! Loading: open and validate, then fill a fresh optimizer's own export template with the
//! overlapping pieces (resharding), import, force a parameter sync.

use std::fs::{self, File};
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};

use lowbit_device::Device;
use lowbit_layout::ParamSpec;
use lowbit_optim::{Optimizer, StateViews};

use crate::convert::LoadOptions;
use crate::error::{CkptError, Result, io};
use crate::manifest::{Manifest, Meta, OptimizerEntry, TensorEntry};
use crate::read::{Parts, Request};
use crate::read_views::ViewRequest;
use crate::save::MANIFEST;

/// Bytes of a manifest at most (a hostile file cannot make the loader read gigabytes).
const MAX_MANIFEST_BYTES: u64 = 256 << 20;

/// An opened, validated checkpoint directory.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
}

impl Checkpoint {
    /// Opens `path`: a `step-N` directory (holding `manifest.json`) or a checkpoint root (its
    /// `latest` pointer is followed). The manifest is parsed and validated (format version,
    /// shapes, every piece in range and in a listed file, the pieces of every tensor tiling it
    /// exactly once) and every data file's size is checked, so a truncated file is refused
    /// here; piece hashes are checked when pieces are read ([`Checkpoint::verify`] reads all).
    /// Nothing is written.
    ///
    /// # Errors
    /// [`CkptError::NotACheckpoint`], [`CkptError::Manifest`], [`CkptError::Version`],
    /// [`CkptError::FileSize`], I/O errors.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let dir = if path.join(MANIFEST).is_file() {
            path.to_path_buf()
        } else if let Some(name) = crate::check::read_latest(path)? {
            let dir = path.join(name);
            if !dir.join(MANIFEST).is_file() {
                return Err(CkptError::NotACheckpoint(dir));
            }
            dir
        } else {
            return Err(CkptError::NotACheckpoint(path.to_path_buf()));
        };
        let mpath = dir.join(MANIFEST);
        let bytes = read_bounded(&mpath, MAX_MANIFEST_BYTES)?;
        let bad = |msg: String| CkptError::Manifest {
            file: mpath.clone(),
            msg,
        };
        let text = String::from_utf8(bytes).map_err(|_| bad("not UTF-8".into()))?;
        // Streamed: the tensor list never becomes one JSON tree.
        let manifest = Manifest::parse(&mpath, &text)?;
        drop(text);
        for f in &manifest.files {
            let p = dir.join(&f.name);
            let meta = fs::metadata(&p).map_err(io("stat", &p))?;
            if !meta.is_file() {
                return Err(CkptError::NotAFile {
                    file: p,
                    kind: file_kind(&meta),
                });
            }
            let actual = meta.len();
            if actual != f.bytes {
                return Err(CkptError::FileSize {
                    file: p,
                    expected: f.bytes,
                    actual,
                });
            }
        }
        Ok(Checkpoint { dir, manifest })
    }

    /// The checkpoint directory (`…/step-N`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// Step, configuration, data position and RNG state.
    pub fn meta(&self) -> &Meta {
        &self.manifest.meta
    }

    /// Proves the checkpoint loadable as far as it can without a model: every data file is a
    /// safetensors file whose header agrees with the manifest (every entry a listed piece, every
    /// piece an entry of its dtype, shape and offset), every piece hashes to the manifest's
    /// value, and a directory named `step-N` holds the manifest of step N. Whether the tensors
    /// are the ones a model needs is the caller's check (names and shapes against it).
    ///
    /// # Errors
    /// [`CkptError::Header`], [`CkptError::Hash`], [`CkptError::StepName`], I/O errors.
    pub fn verify(&self) -> Result<()> {
        crate::check::check_headers(&self.dir, &self.manifest)?;
        crate::read::verify(&self.dir, &self.manifest.tensors)?;
        crate::check::check_step_name(&self.dir, &self.manifest)
    }

    /// Elements `range` of the logical tensor `name` (`{parameter}/{state}`), read from the
    /// pieces that overlap it (each hash-checked).
    ///
    /// # Errors
    /// [`CkptError::Mismatch`] for an unknown tensor or a range out of bounds;
    /// [`CkptError::Hash`], I/O errors.
    pub fn read_range(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>> {
        let t = self
            .manifest
            .tensor(name)
            .ok_or_else(|| self.mismatch(format!("no tensor `{name}`")))?;
        self.read_parts(name, vec![(t, 0..t.numel())], range)
    }

    fn mismatch(&self, msg: String) -> CkptError {
        CkptError::Mismatch {
            dir: self.dir.clone(),
            msg,
        }
    }

    /// Restores `opt` (built over this rank's plan, any dp and either sharded strategy): every
    /// state tensor it holds is filled from the pieces that overlap its range (so the pieces
    /// are re-cut to this rank's plan and no rank reads pieces it does not need), streamed
    /// into its [`Optimizer::state_views`] (or, without views, into its export template, then
    /// [`Optimizer::import_state`]), and step counts are restored. Parameters are matched by
    /// name, shapes must be equal, rules must be equal. The weights are not touched: follow
    /// with a forced parameter sync (the step driver's `Trainer::load_checkpoint` does).
    ///
    /// # Errors
    /// [`CkptError::Mismatch`] (nothing is written then); [`CkptError::Hash`] and I/O errors
    /// (found while streaming: part of the state may be written, so do not use `opt` after
    /// them; [`Checkpoint::verify`] first refuses before anything is written); optimizer and
    /// device errors.
    pub fn load_optimizer(
        &self,
        dev: &mut Device,
        specs: &[ParamSpec],
        opt: &mut dyn Optimizer,
    ) -> Result<()> {
        self.load_optimizer_with(dev, specs, opt, &LoadOptions::default())
    }

    /// [`Checkpoint::load_optimizer`] with `options`: a parameter the checkpoint does not hold
    /// under its own name is assembled through its [`crate::Alias`] (its element count must
    /// match the model's; shapes may differ, e.g. per-expert `[out, in]` from a grouped
    /// `[experts, out, in]` tensor, or the reverse).
    ///
    /// # Errors
    /// As [`Checkpoint::load_optimizer`].
    pub fn load_optimizer_with(
        &self,
        dev: &mut Device,
        specs: &[ParamSpec],
        opt: &mut dyn Optimizer,
        options: &LoadOptions,
    ) -> Result<()> {
        if let Some(views) = opt.state_views() {
            return self.stream_into(dev, specs, opt, &views, options);
        }
        // The optimizer's own export is the template (its zeroed buffers the destinations).
        let mut state = opt.export_template(dev)?;
        let mut requests = Vec::new();
        for st in &mut state {
            st.steps = self.optimizer_entry(st.owner.0, &st.rule)?.steps;
            for t in &mut st.tensors {
                let (name, parts) = self.tensor_parts(specs, t.param, &t.name, options)?;
                t.values.resize(t.range.len(), 0.0);
                requests.push(Request {
                    name,
                    parts,
                    want: t.range.start as u64..t.range.end as u64,
                    out: &mut t.values,
                });
            }
        }
        // Every piece of the whole load at once: the cores share the reads and the hashing.
        crate::read::fill(&self.dir, requests, |m| self.mismatch(m))?;
        opt.check_import(&state)?;
        opt.import_state(dev, &state)?;
        Ok(())
    }

    /// [`Checkpoint::load_optimizer_with`] for an optimizer with state views: every piece is
    /// read into the views directly (checked first: owners, rules, names, shapes, coverage),
    /// then the step counts are set.
    fn stream_into(
        &self,
        dev: &mut Device,
        specs: &[ParamSpec],
        opt: &mut dyn Optimizer,
        views: &[StateViews],
        options: &LoadOptions,
    ) -> Result<()> {
        let mut requests = Vec::new();
        let mut steps = Vec::new();
        for st in views {
            let entry = self.optimizer_entry(st.owner.0, &st.rule)?;
            steps.push((st.owner, entry.steps));
            for t in &st.tensors {
                let (name, parts) = self.tensor_parts(specs, t.param, &t.name, options)?;
                requests.push(ViewRequest {
                    name,
                    parts,
                    want: t.range.start as u64..t.range.end as u64,
                    view: t.view,
                });
            }
        }
        crate::read_views::fill_views(&self.dir, dev, requests, |m| self.mismatch(m))?;
        for (owner, n) in steps {
            opt.set_steps(owner, n)?;
        }
        Ok(())
    }

    /// The logical name `{param}/{state}` of state `state` of parameter `param` (an index into
    /// `specs`) and the stored tensors and ranges it is read from ([`Self::resolve`]).
    fn tensor_parts(
        &self,
        specs: &[ParamSpec],
        param: usize,
        state: &str,
        options: &LoadOptions,
    ) -> Result<(String, Parts<'_>)> {
        let spec = specs
            .get(param)
            .ok_or_else(|| self.mismatch(format!("parameter {param} of {} specs", specs.len())))?;
        let shape: Vec<u64> = spec.shape.iter().map(|&d| d as u64).collect();
        let parts = self.resolve(&spec.name, state, &shape, options)?;
        Ok((format!("{}/{state}", spec.name), parts))
    }

    /// The saved optimizer of `owner`, which must have used `rule`.
    fn optimizer_entry(&self, owner: u32, rule: &str) -> Result<&OptimizerEntry> {
        let Some(entry) = self.manifest.optimizers.iter().find(|o| o.owner == owner) else {
            return Err(self.mismatch(format!("no optimizer state for owner {owner}")));
        };
        if entry.rule != rule {
            return Err(self.mismatch(format!(
                "owner {owner} was saved with rule `{}`, is loaded with `{rule}`",
                entry.rule
            )));
        }
        Ok(entry)
    }

    /// The whole tensor `{param}/{state}` of global shape `shape` (flattened), through
    /// `options`' aliases when the checkpoint does not hold it under that name; every piece read
    /// is hash-checked. What an export of full weights reads.
    ///
    /// # Errors
    /// [`CkptError::Mismatch`] (absent, or another shape), [`CkptError::Hash`], I/O errors.
    pub fn read_param(
        &self,
        param: &str,
        state: &str,
        shape: &[u64],
        options: &LoadOptions,
    ) -> Result<Vec<f32>> {
        let parts = self.resolve(param, state, shape, options)?;
        let numel = parts.iter().map(|(_, r)| r.end - r.start).sum::<u64>();
        let n = usize::try_from(numel)
            .map_err(|_| self.mismatch(format!("`{param}/{state}` is too large")))?;
        self.read_parts(&format!("{param}/{state}"), parts, 0..n)
    }

    /// The stored tensors and element ranges that make up `{param}/{state}`, in order: the
    /// tensor itself (shape checked), or its alias' segments (element count checked).
    fn resolve(
        &self,
        param: &str,
        state: &str,
        shape: &[u64],
        options: &LoadOptions,
    ) -> Result<Vec<(&TensorEntry, Range<u64>)>> {
        let name = format!("{param}/{state}");
        let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if let Some(entry) = self.manifest.tensor(&name) {
            if entry.shape != shape {
                return Err(self.mismatch(format!(
                    "`{name}` has shape {:?} in the checkpoint, {shape:?} in the model",
                    entry.shape
                )));
            }
            return Ok(vec![(entry, 0..entry.numel())]);
        }
        let Some(alias) = options.alias(param) else {
            return Err(self.mismatch(format!("no tensor `{name}` in the checkpoint")));
        };
        if Some(alias.numel()) != numel {
            return Err(self.mismatch(format!(
                "`{name}` (shape {shape:?}) is absent and its alias assembles {} elements",
                alias.numel()
            )));
        }
        alias
            .sources
            .iter()
            .map(|seg| {
                let src = format!("{}/{state}", seg.param);
                let entry = self.manifest.tensor(&src).ok_or_else(|| {
                    self.mismatch(format!(
                        "no tensor `{name}` in the checkpoint, nor `{src}` it is assembled from"
                    ))
                })?;
                let end = seg
                    .start
                    .checked_add(seg.len)
                    .filter(|&e| e <= entry.numel());
                let Some(end) = end else {
                    return Err(self.mismatch(format!(
                        "`{name}` is assembled from elements [{}, +{}) of `{src}`, which has {}",
                        seg.start,
                        seg.len,
                        entry.numel()
                    )));
                };
                Ok((entry, seg.start..end))
            })
            .collect()
    }

    /// Elements `want` of the concatenation of `parts` (the tensor `name`).
    fn read_parts(
        &self,
        name: &str,
        parts: Vec<(&TensorEntry, Range<u64>)>,
        want: Range<usize>,
    ) -> Result<Vec<f32>> {
        let total: u64 = parts.iter().map(|(_, r)| r.end - r.start).sum();
        if want.start > want.end || want.end as u64 > total {
            return Err(self.mismatch(format!("range {want:?} of `{name}` with {total} elements")));
        }
        let mut out = vec![0.0; want.len()];
        let request = Request {
            name: name.to_string(),
            parts,
            want: want.start as u64..want.end as u64,
            out: &mut out,
        };
        crate::read::fill(&self.dir, vec![request], |m| self.mismatch(m))?;
        Ok(out)
    }
}

/// The bytes of `path`, refused when over `max`: by its size before reading (nothing is
/// allocated for a file too large), and by what was read (a file that grew meanwhile).
fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>> {
    let too_large = || CkptError::Manifest {
        file: path.to_path_buf(),
        msg: format!(
            "larger than {} MiB ({max} bytes), the most a manifest may hold; not read",
            max >> 20
        ),
    };
    let f = File::open(path).map_err(io("open", path))?;
    let len = f.metadata().map_err(io("stat", path))?.len();
    if len > max {
        return Err(too_large());
    }
    let mut out = Vec::with_capacity(len as usize);
    f.take(max + 1)
        .read_to_end(&mut out)
        .map_err(io("read", path))?;
    if out.len() as u64 > max {
        return Err(too_large());
    }
    Ok(out)
}

/// What a path that is not a regular file is, for messages.
fn file_kind(meta: &fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a directory"
    } else {
        "not a file"
    }
}
