//! The device memory of each sequence and the steps that append tokens to it: a slot per
//! sequence (position, input token, KV caches, DeltaNet conv and recurrent state, sampling
//! settings, and the step graphs captured for it), the tables that point a batched step's rows
//! at their slots, and the launches of a step and the reads of what it chose.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, ensure};
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice};

use super::CudaBackend;
use super::decode::StepSeqs;
use super::weights::ptr;
use crate::backend::{DeviceDraw, PenaltyHistory};
use crate::config::{LayerKind, ModelConfig};

/// The per-sequence buffers of a batched decode step, for its kernels to look up (`seq_buffer`
/// in common.cuh): a column of `rows` device addresses per kind of buffer and layer, row b for
/// the sequence whose token is row b of the step. A batched graph reads the table, so the same
/// graph serves any sequences once the table points at them.
pub(super) struct BatchTables {
    pub(super) table: CudaSlice<u64>,
    rows: usize,
    deltanet_layers: usize,
    attention_layers: usize,
    /// The slots the table's first rows point at, in row order.
    holds: Vec<usize>,
}

impl BatchTables {
    pub(super) const POSITION: usize = 0;
    pub(super) const TOKEN: usize = 1;
    pub(super) const SAMPLING: usize = 2;
    pub(super) const HISTORY: usize = 3;
    const PER_SEQUENCE: usize = 4;

    pub(super) fn new(stream: &Arc<CudaStream>, c: &ModelConfig, rows: usize) -> Result<Self> {
        let attention_layers = c
            .layer_kinds
            .iter()
            .filter(|k| **k == LayerKind::FullAttention)
            .count();
        let deltanet_layers = c.layer_kinds.len() - attention_layers;
        let fields = Self::PER_SEQUENCE + 2 * deltanet_layers + 2 * attention_layers;
        Ok(Self {
            table: stream.alloc_zeros::<u64>(fields * rows)?,
            rows,
            deltanet_layers,
            attention_layers,
            holds: Vec::new(),
        })
    }

    pub(super) fn conv(&self, i: usize) -> usize {
        Self::PER_SEQUENCE + i
    }

    pub(super) fn state(&self, i: usize) -> usize {
        Self::PER_SEQUENCE + self.deltanet_layers + i
    }

    pub(super) fn keys(&self, i: usize) -> usize {
        Self::PER_SEQUENCE + 2 * self.deltanet_layers + i
    }

    pub(super) fn values(&self, i: usize) -> usize {
        Self::PER_SEQUENCE + 2 * self.deltanet_layers + self.attention_layers + i
    }

    /// The device address of column `field`.
    pub(super) fn column(&self, field: usize, s: &CudaStream) -> u64 {
        ptr(&self.table, s) + (field * self.rows * std::mem::size_of::<u64>()) as u64
    }

    /// Points the first rows at the buffers of `ids` (slots of `slots`, in row order); uploads
    /// only when they are not the ones the table already holds.
    pub(super) fn hold(
        &mut self,
        slots: &[Slot],
        ids: &[usize],
        s: &Arc<CudaStream>,
    ) -> Result<()> {
        ensure!(
            ids.len() <= self.rows,
            "a batch of {} sequences is more than the {} the backend holds",
            ids.len(),
            self.rows
        );
        if self.holds == ids {
            return Ok(());
        }
        let rows = self.rows;
        let mut host = vec![0u64; self.table.len()];
        for (row, &id) in ids.iter().enumerate() {
            let slot = &slots[id];
            let mut set = |field: usize, address: u64| host[field * rows + row] = address;
            set(Self::POSITION, ptr(&slot.position, s));
            set(Self::TOKEN, ptr(&slot.token, s));
            set(Self::SAMPLING, ptr(&slot.sampling, s));
            set(Self::HISTORY, ptr(&slot.history, s));
            for (i, (conv, state)) in slot.conv.iter().zip(&slot.recurrent).enumerate() {
                set(self.conv(i), ptr(conv, s));
                set(self.state(i), ptr(state, s));
            }
            for (i, (k, v)) in slot.kv.iter().enumerate() {
                set(self.keys(i), ptr(k, s));
                set(self.values(i), ptr(v, s));
            }
        }
        s.memcpy_htod(&host, &mut self.table)?;
        self.holds = ids.to_vec();
        Ok(())
    }
}

/// Batched decode: the tables its graphs read, and one graph per (batch size, ending), captured
/// on first use.
pub(super) struct BatchSteps {
    pub(super) tables: BatchTables,
    pub(super) graphs: HashMap<(usize, StepEnd), Graph>,
}

/// A CUDA graph that may be replayed from whichever thread drives the backend.
pub(super) struct Graph(pub(super) CudaGraph);
// SAFETY: a graph exec handle is a driver object usable from any thread once the context is
// current; cudarc binds the context before every launch. The backend serialises launches.
unsafe impl Send for Graph {}

/// Eight bytes of page-locked host memory mapped into the device, through which one slot's
/// steps tell the host the id they chose (`announce_choice` in sample.cu): the host polls it
/// instead of copying the token back, which waits for the whole step and then for a copy.
pub(super) struct MappedWord {
    /// Owns the allocation (freed on drop).
    _allocation: PinnedHostSlice<u64>,
    /// Its one u64, as the host reads it.
    host: *mut u64,
    device: u64,
}

// SAFETY: `host` points into the allocation the struct owns, which lives as long as it; the
// device only writes the word, the host reads it (volatile) and clears it only while no step
// of the slot is in flight.
unsafe impl Send for MappedWord {}
// SAFETY: as for Send.
unsafe impl Sync for MappedWord {}

impl MappedWord {
    fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        // SAFETY: the word is written below before anything reads it.
        let mut allocation = unsafe {
            stream
                .context()
                .alloc_pinned_with_flags::<u64>(1, sys::CU_MEMHOSTALLOC_DEVICEMAP)
        }?;
        let word = allocation.as_mut_ptr()?;
        // SAFETY: `word` is the allocation's one u64; nothing on the device uses it yet.
        unsafe { word.write_volatile(0) };
        let mut device = 0;
        // SAFETY: `word` was allocated with CU_MEMHOSTALLOC_DEVICEMAP in the stream's context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, word.cast(), 0) }
            .result()
            .context("mapping a page-locked word into the device")?;
        Ok(Self {
            _allocation: allocation,
            host: word,
            device,
        })
    }

    /// The word's address on the device.
    pub(super) fn device_address(&self) -> u64 {
        self.device
    }

    /// Forgets what an earlier sequence of the slot was told (before a new one starts at
    /// position 0, whose steps would otherwise find their positions already there).
    pub(super) fn clear(&self) {
        // SAFETY: as in `read`; no step of the slot is in flight (each one's word was read).
        unsafe { self.host.write_volatile(0) }
    }

    /// The word as the device last wrote it.
    fn read(&self) -> u64 {
        // SAFETY: the allocation's one u64, aligned; the device may write it at any time, so
        // it is read volatile, in one 8-byte load (as the device stores it).
        unsafe { self.host.read_volatile() }
    }
}

/// The device memory of one sequence.
pub(super) struct Slot {
    pub(super) position: CudaSlice<i32>,
    pub(super) token: CudaSlice<i32>,
    /// Where the slot's greedy and sampled steps tell the host their id.
    pub(super) announce: MappedWord,
    /// Per attention layer: keys and values, bf16 `[max_context, kv_heads, head_dim]`.
    pub(super) kv: Vec<(CudaSlice<u16>, CudaSlice<u16>)>,
    /// Per DeltaNet layer: conv input ring `[kernel, conv_dim]` and recurrent state.
    pub(super) conv: Vec<CudaSlice<f32>>,
    pub(super) recurrent: Vec<CudaSlice<f32>>,
    /// Sampling settings and seed of the next sampled step (`struct SamplingDesc` in sample.cu).
    pub(super) sampling: CudaSlice<SamplingDesc>,
    /// The penalty history of penalised draws, a word per id of the vocabulary: HISTORY_SEEN
    /// (bit 31) once the id was seen in the prompt or generated, the low bits the times it was
    /// generated. Loaded by `load_penalty_history`, counted on by `sample_finish`.
    pub(super) history: CudaSlice<u32>,
    greedy_graph: Option<Graph>,
    sampled_graph: Option<Graph>,
    logits_graph: Option<Graph>,
}

/// How a decode step ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum StepEnd {
    /// The argmax becomes the next input token on the device.
    Greedy,
    /// A draw with the slot's sampling settings becomes the next input token on the device.
    Sampled,
    /// The logits are left for the host to read.
    Logits,
}

/// HISTORY_SEEN in sample.cu: the bit of a history word set once its id was seen.
const HISTORY_SEEN: u32 = 1 << 31;

/// A slot's penalty history as the draw kernels read it: a word per id of a vocabulary of
/// `vocab`, HISTORY_SEEN for every id seen, the low bits the times it was generated.
fn history_words(history: &PenaltyHistory, vocab: usize) -> Result<Vec<u32>> {
    let ids = history
        .seen
        .iter()
        .chain(history.generated.iter().map(|(id, _)| id));
    if let Some(bad) = ids.copied().find(|&id| id as usize >= vocab) {
        anyhow::bail!("penalty history: token id {bad} is outside the vocabulary (size {vocab})");
    }
    let mut words = vec![0u32; vocab];
    for &id in &history.seen {
        words[id as usize] |= HISTORY_SEEN;
    }
    for &(id, count) in &history.generated {
        words[id as usize] = HISTORY_SEEN | count.min(!HISTORY_SEEN);
    }
    Ok(words)
}

/// `struct SamplingDesc` in sample.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SamplingDesc {
    temperature: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    allowed: i32,
    repetition: f32,
    presence: f32,
    frequency: f32,
    greedy: i32,
    seed: u64,
}

// SAFETY: plain old data with the layout of `struct SamplingDesc` in sample.cu.
unsafe impl DeviceRepr for SamplingDesc {}

impl Slot {
    /// Device memory of the sequence's buffers (its captured graphs are the driver's).
    pub(super) fn bytes(&self) -> usize {
        self.position.num_bytes()
            + self.token.num_bytes()
            + self.sampling.num_bytes()
            + self.history.num_bytes()
            + self
                .kv
                .iter()
                .map(|(k, v)| k.num_bytes() + v.num_bytes())
                .sum::<usize>()
            + self
                .conv
                .iter()
                .chain(&self.recurrent)
                .map(|v| v.num_bytes())
                .sum::<usize>()
    }

    /// The captured step that ends as `end` says.
    fn graph(&mut self, end: StepEnd) -> &mut Option<Graph> {
        match end {
            StepEnd::Greedy => &mut self.greedy_graph,
            StepEnd::Sampled => &mut self.sampled_graph,
            StepEnd::Logits => &mut self.logits_graph,
        }
    }
}

/// The per-sequence handle: a slot of the backend's pool.
pub struct CudaState {
    pub(super) slot: usize,
    pub(super) position: usize,
    /// The token the device already holds as the next input (chosen by its own argmax).
    pub(super) device_token: Option<u32>,
    pub(super) free: Arc<Mutex<Vec<usize>>>,
}

impl Drop for CudaState {
    fn drop(&mut self) {
        if let Ok(mut free) = self.free.lock() {
            free.push(self.slot);
        }
    }
}

/// Elements of a slot's per-layer buffers.
struct SlotLengths {
    /// Keys (and as many values) of one attention layer, bf16.
    kv: usize,
    /// One DeltaNet layer's conv ring and recurrent state, f32.
    conv: usize,
    recurrent: usize,
}

impl SlotLengths {
    fn of(c: &ModelConfig, max_context: usize) -> Self {
        Self {
            kv: max_context * c.num_key_value_heads * c.head_dim,
            conv: c.linear_conv_kernel_dim * c.linear_conv_dim(),
            recurrent: c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim,
        }
    }
}

/// Device bytes one sequence slot of `max_context` positions takes (what [`Slot::bytes`] counts
/// once it is allocated).
pub(super) fn slot_bytes(c: &ModelConfig, max_context: usize) -> usize {
    let lengths = SlotLengths::of(c, max_context);
    let layers = |kind: LayerKind| c.layer_kinds.iter().filter(|&&k| k == kind).count();
    layers(LayerKind::FullAttention) * 2 * lengths.kv * size_of::<u16>()
        + layers(LayerKind::LinearAttention) * (lengths.conv + lengths.recurrent) * size_of::<f32>()
        + 2 * size_of::<i32>()
        + size_of::<SamplingDesc>()
        + c.vocab_size * size_of::<u32>()
}

impl CudaBackend {
    pub(super) fn new_slot(
        stream: &Arc<CudaStream>,
        c: &ModelConfig,
        max_context: usize,
    ) -> Result<Slot> {
        let lengths = SlotLengths::of(c, max_context);
        let mut slot = Slot {
            position: stream.alloc_zeros::<i32>(1)?,
            token: stream.alloc_zeros::<i32>(1)?,
            announce: MappedWord::new(stream)?,
            kv: Vec::new(),
            conv: Vec::new(),
            recurrent: Vec::new(),
            sampling: stream.clone_htod(&[SamplingDesc::default()])?,
            history: stream.alloc_zeros::<u32>(c.vocab_size)?,
            greedy_graph: None,
            sampled_graph: None,
            logits_graph: None,
        };
        for kind in &c.layer_kinds {
            match kind {
                LayerKind::FullAttention => slot.kv.push((
                    stream.alloc_zeros::<u16>(lengths.kv)?,
                    stream.alloc_zeros::<u16>(lengths.kv)?,
                )),
                LayerKind::LinearAttention => {
                    slot.conv.push(stream.alloc_zeros::<f32>(lengths.conv)?);
                    slot.recurrent
                        .push(stream.alloc_zeros::<f32>(lengths.recurrent)?);
                }
            }
        }
        Ok(slot)
    }

    pub(super) fn lock_batch(&self) -> Result<std::sync::MutexGuard<'_, BatchSteps>> {
        self.batch
            .lock()
            .map_err(|_| anyhow::anyhow!("batch lock poisoned"))
    }

    pub(super) fn lock_slots(&self) -> Result<std::sync::MutexGuard<'_, Vec<Slot>>> {
        self.slots
            .lock()
            .map_err(|_| anyhow::anyhow!("slot lock poisoned"))
    }

    /// Checks that `token` may be appended to the sequence of `state`.
    fn check_step(&self, state: &CudaState, token: u32) -> Result<()> {
        ensure!(
            (token as usize) < self.config.vocab_size,
            "token id {token} is outside the vocabulary (size {})",
            self.config.vocab_size
        );
        ensure!(
            state.position < self.max_context,
            "the sequence reached the context limit of {} tokens",
            self.max_context
        );
        Ok(())
    }

    /// Runs one decode step for the state's slot (capturing its graph on first use).
    pub(super) fn step(&self, state: &mut CudaState, token: u32, end: StepEnd) -> Result<()> {
        self.check_step(state, token)?;
        let mut slots = self.lock_slots()?;
        let slot = &mut slots[state.slot];
        if state.device_token != Some(token) {
            self.stream.memcpy_htod(&[token as i32], &mut slot.token)?;
        }
        if self.use_graphs {
            if slot.graph(end).is_none() {
                *slot.graph(end) = Some(Graph(self.capture_step(StepSeqs::Slot(slot), end)?));
            }
            if let Some(graph) = slot.graph(end) {
                graph.0.launch()?;
            }
        } else {
            self.record_step(StepSeqs::Slot(slot), end)?;
        }
        state.position += 1;
        state.device_token = None;
        Ok(())
    }

    /// Runs one batched decode step: a token of each sequence, in one pass through the model
    /// (the graph of this batch size, captured on first use, replayed with the batch tables
    /// pointing at these sequences). One sequence takes `step` instead.
    pub(super) fn step_batch(
        &self,
        states: &mut [&mut CudaState],
        tokens: &[u32],
        end: StepEnd,
    ) -> Result<()> {
        if states.is_empty() && tokens.is_empty() {
            return Ok(());
        }
        ensure!(
            states.len() == tokens.len(),
            "a decode step got {} sequences but {} tokens",
            states.len(),
            tokens.len()
        );
        for (state, &token) in states.iter().zip(tokens) {
            self.check_step(state, token)?;
        }
        // Lock order, here and in decode_critical_path: batch, slots.
        let mut batch = self.lock_batch()?;
        let ids: Vec<usize> = states.iter().map(|s| s.slot).collect();
        let BatchSteps { tables, graphs } = &mut *batch;
        {
            let mut slots = self.lock_slots()?;
            for (state, &token) in states.iter().zip(tokens) {
                if state.device_token != Some(token) {
                    self.stream
                        .memcpy_htod(&[token as i32], &mut slots[state.slot].token)?;
                }
            }
            tables.hold(&slots, &ids, &self.stream)?;
        }
        let seqs = StepSeqs::Batch(tables, ids.len());
        if self.use_graphs {
            let graph = match graphs.entry((ids.len(), end)) {
                Entry::Occupied(graph) => graph.into_mut(),
                Entry::Vacant(place) => place.insert(Graph(self.capture_step(seqs, end)?)),
            };
            graph.0.launch()?;
        } else {
            self.record_step(seqs, end)?;
        }
        for state in states.iter_mut() {
            state.position += 1;
            state.device_token = None;
        }
        Ok(())
    }

    /// The ids a batched step chose, a row each; they stay on the device as the next inputs.
    pub(super) fn read_chosen(&self, states: &mut [&mut CudaState]) -> Result<Vec<u32>> {
        if states.is_empty() {
            return Ok(Vec::new());
        }
        let ids = self
            .stream
            .clone_dtoh(&self.scratch.chosen.slice(..states.len()))?;
        Ok(states
            .iter_mut()
            .zip(ids)
            .map(|(state, id)| {
                state.device_token = Some(id as u32);
                id as u32
            })
            .collect())
    }

    /// Sets the draw of the sequence's next sampled step (queued, so behind the steps before).
    pub(super) fn set_draw(&self, state: &CudaState, draw: &DeviceDraw) -> Result<()> {
        ensure!(
            draw.greedy || (draw.temperature.is_finite() && draw.temperature > 0.0),
            "device sampling needs a positive temperature, not {}",
            draw.temperature
        );
        let p = &draw.penalties;
        ensure!(
            p.repetition.is_finite()
                && p.repetition > 0.0
                && p.presence.is_finite()
                && p.frequency.is_finite(),
            "device sampling needs finite penalties and a positive repetition penalty, not {p:?}"
        );
        // A greedy draw takes the most likely id: no temperature, no filters.
        let (temperature, top_k, top_p, min_p) = if draw.greedy {
            (1.0, 0, 1.0, 0.0)
        } else {
            let top_k = i32::try_from(draw.top_k).unwrap_or(0);
            (draw.temperature, top_k, draw.top_p, draw.min_p)
        };
        let desc = SamplingDesc {
            temperature,
            top_k,
            top_p,
            min_p,
            allowed: i32::try_from(draw.allowed.min(self.config.vocab_size)).unwrap_or(i32::MAX),
            repetition: p.repetition,
            presence: p.presence,
            frequency: p.frequency,
            greedy: i32::from(draw.greedy),
            seed: draw.seed,
        };
        let mut slots = self.lock_slots()?;
        self.stream
            .memcpy_htod(&[desc], &mut slots[state.slot].sampling)?;
        Ok(())
    }

    /// Replaces the slot's penalty history (see `Slot::history`); queued, so behind the steps
    /// before.
    pub(super) fn load_history(&self, state: &CudaState, history: &PenaltyHistory) -> Result<()> {
        let words = history_words(history, self.config.vocab_size)?;
        let mut slots = self.lock_slots()?;
        self.stream
            .memcpy_htod(&words, &mut slots[state.slot].history)?;
        Ok(())
    }

    /// The token the last step chose on the device (it stays there as the next input).
    pub(super) fn read_token(&self, state: &mut CudaState) -> Result<u32> {
        let slots = self.lock_slots()?;
        let slot = &slots[state.slot];
        // The step's word carries the position after it, which `step` has already counted.
        let position = u32::try_from(state.position).context("position out of range")?;
        let mut polls = 0u32;
        let id = loop {
            polls = polls.wrapping_add(1);
            // Now and then, whether the stream has ended (or failed), asked before the read so
            // that the word read after an ended stream is its last: if it is not the step's,
            // the token is copied back as before, so a missing word costs time, never a hang.
            let ended = polls.is_multiple_of(4096) && !self.stream_busy()?;
            let word = slot.announce.read();
            if (word >> 32) as u32 == position {
                break word as u32;
            }
            if ended {
                tracing::warn!(slot = state.slot, position, "a step's id was not announced");
                break self.stream.clone_dtoh(&slot.token)?[0] as u32;
            }
            std::hint::spin_loop();
        };
        state.device_token = Some(id);
        Ok(id)
    }

    /// Whether work queued on the stream is still running (an error it ended with comes back).
    fn stream_busy(&self) -> Result<bool> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: the stream is the backend's own, alive for as long as it is.
        match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
            CUresult::CUDA_SUCCESS => Ok(false),
            CUresult::CUDA_ERROR_NOT_READY => Ok(true),
            other => {
                other.result().context("the decode step failed")?;
                Ok(false)
            }
        }
    }

    /// Copies the logits of the last step's row `row` to the host.
    pub(super) fn read_logits_row(&self, row: usize) -> Result<Vec<f32>> {
        let v = self.config.vocab_size;
        Ok(self
            .stream
            .clone_dtoh(&self.scratch.logits.slice(row * v..(row + 1) * v))?)
    }

    /// Copies the logits of the last step's `rows` sequences to the host.
    pub(super) fn read_logits(&self, rows: usize) -> Result<Vec<f32>> {
        let n = rows * self.config.vocab_size;
        Ok(self.stream.clone_dtoh(&self.scratch.logits.slice(..n))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalty_histories_become_a_word_per_id() {
        let history = PenaltyHistory {
            seen: vec![1, 4, 6],
            generated: vec![(4, 3), (5, 1)],
        };
        let words = history_words(&history, 8).unwrap();
        let seen = HISTORY_SEEN;
        assert_eq!(words, [0, seen, 0, 0, seen | 3, seen | 1, seen, 0]);
        let outside = PenaltyHistory {
            seen: vec![2],
            generated: vec![(8, 1)],
        };
        let error = history_words(&outside, 8).unwrap_err().to_string();
        assert!(error.contains("token id 8"), "{error}");
    }

    #[test]
    fn a_slot_of_the_35b_at_32k_takes_about_0_74_gb() {
        let text = include_str!("../../../configs/qwen3.6-35b-a3b.json");
        let c = ModelConfig::from_json_str(text).unwrap();
        // 10 attention layers: keys and values of 2 heads x 256, bf16; 30 DeltaNet layers: a
        // 4-tap ring of 8,192 channels and 32 states of 128 x 128, f32.
        let kv = 10 * 2 * 32768 * 2 * 256 * 2;
        let deltanet = 30 * (4 * 8192 + 32 * 128 * 128) * 4;
        let small = 2 * 4 + size_of::<SamplingDesc>() + 248_320 * 4;
        assert_eq!(slot_bytes(&c, 32768), kv + deltanet + small);
        assert_eq!(kv + deltanet, 737_935_360);
    }
}
