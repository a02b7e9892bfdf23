//! Where prefill time goes: when enabled, the prefill path records a CUDA event at the end of each
//! part of a layer (projections, DeltaNet, attention, MoE, lm_head) and the timer sums the GPU
//! time between consecutive events per part. Off by default: recording events costs a driver call
//! each, so only `lily bench` turns it on, for a run of its own. Decode is timed per kernel on
//! its critical path, from truncated replays of the step's graph (`LaunchPrefix`).

use std::sync::Mutex;

use anyhow::{Result, ensure};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

use super::{CudaBackend, CudaState, StepEnd, StepSeqs};

/// The parts prefill time is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillPart {
    /// Embedding, the mixers' input and output projections, and their norms.
    Projections,
    /// The Gated DeltaNet core: conv, norms, gates, the recurrence and the gated norm.
    DeltaNet,
    /// The attention core: q/k norms, RoPE, the KV-cache append and attention itself.
    Attention,
    /// Router, routed experts and shared expert.
    Moe,
    /// The final norm and lm_head for the positions whose logits are returned.
    LmHead,
}

impl PrefillPart {
    pub const ALL: [PrefillPart; 5] = [
        PrefillPart::Projections,
        PrefillPart::DeltaNet,
        PrefillPart::Attention,
        PrefillPart::Moe,
        PrefillPart::LmHead,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PrefillPart::Projections => "projections",
            PrefillPart::DeltaNet => "deltanet",
            PrefillPart::Attention => "attention",
            PrefillPart::Moe => "moe",
            PrefillPart::LmHead => "lm_head",
        }
    }
}

/// Events recorded on one stream, each closing the part it names (the first opens the run).
#[derive(Default)]
pub struct PartTimer {
    start: Option<CudaEvent>,
    marks: Vec<(PrefillPart, CudaEvent)>,
}

impl PartTimer {
    fn event(stream: &CudaStream) -> Result<CudaEvent> {
        Ok(stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    /// Opens the run: the first part starts at the work queued so far.
    pub fn start(&mut self, stream: &CudaStream) -> Result<()> {
        self.start = Some(Self::event(stream)?);
        self.marks.clear();
        Ok(())
    }

    /// Closes `part` at the work queued so far (a no-op before `start`).
    pub fn mark(&mut self, stream: &CudaStream, part: PrefillPart) -> Result<()> {
        if self.start.is_some() {
            self.marks.push((part, Self::event(stream)?));
        }
        Ok(())
    }

    /// Milliseconds of GPU time per part, in `PrefillPart::ALL` order (waits for the events).
    pub fn totals_ms(&self) -> Result<Vec<(PrefillPart, f64)>> {
        let mut totals: Vec<(PrefillPart, f64)> =
            PrefillPart::ALL.iter().map(|&p| (p, 0.0)).collect();
        let Some(mut previous) = self.start.as_ref() else {
            return Ok(totals);
        };
        for (part, event) in &self.marks {
            let ms = previous.elapsed_ms(event)? as f64;
            if let Some(total) = totals.iter_mut().find(|(p, _)| p == part) {
                total.1 += ms;
            }
            previous = event;
        }
        Ok(totals)
    }
}

/// Where decode time goes inside the replayed graph, kernel by kernel. Kernels of a step overlap
/// (programmatic dependent launch), so their own durations do not add up to the step; instead the
/// step is captured truncated after each of its launches in turn, and a launch's share is how much
/// replaying the graph grows when it is added: its cost on the step's critical path.
#[derive(Default)]
pub struct LaunchPrefix {
    recording: Mutex<Option<Recording>>,
}

/// A step being recorded: the most launches to keep, and the names of those issued so far.
struct Recording {
    limit: usize,
    names: Vec<&'static str>,
}

impl LaunchPrefix {
    /// Starts recording a step of at most `limit` launches.
    fn begin(&self, limit: usize) -> Result<()> {
        *self.lock()? = Some(Recording {
            limit,
            names: Vec::new(),
        });
        Ok(())
    }

    /// Stops recording; returns the names of the launches issued.
    fn end(&self) -> Result<Vec<&'static str>> {
        Ok(self.lock()?.take().map(|r| r.names).unwrap_or_default())
    }

    /// Counts a launch named `name`; false when it falls past the limit and must be skipped.
    pub fn admit(&self, name: &'static str) -> Result<bool> {
        Ok(match self.lock()?.as_mut() {
            Some(r) => {
                r.names.push(name);
                r.names.len() <= r.limit
            }
            None => true,
        })
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Option<Recording>>> {
        self.recording
            .lock()
            .map_err(|_| anyhow::anyhow!("launch prefix lock poisoned"))
    }
}

/// One kernel's share of the decode step (see `LaunchPrefix`).
#[derive(Clone, Debug)]
pub struct KernelShare {
    pub name: &'static str,
    pub launches: usize,
    /// Microseconds added to the replayed step by all of its launches together.
    pub critical_us: f64,
}

impl CudaBackend {
    /// Replays the greedy decode step of `states` (one sequence's step, or a batched step of
    /// all of them) truncated after each launch, `reps` times each, and returns each kernel's
    /// share of the step (in order of first launch) and the full step's time in microseconds.
    /// The positions do not advance except in the full step, which advances them `reps + 1`
    /// times.
    pub fn decode_critical_path(
        &self,
        states: &mut [&mut CudaState],
        reps: usize,
    ) -> Result<(Vec<KernelShare>, f64)> {
        ensure!(
            reps > 0,
            "the critical path needs at least one replay per step"
        );
        ensure!(!states.is_empty(), "the critical path needs a sequence");
        for state in states.iter() {
            ensure!(
                state.position + reps < self.max_context,
                "timing the critical path advances the sequence {} positions past {}, beyond \
                 the context limit of {}",
                reps + 1,
                state.position,
                self.max_context
            );
        }
        // The lock order of CudaBackend::step_batch.
        let mut batch = self.lock_batch()?;
        let slots = self.lock_slots()?;
        let ids: Vec<usize> = states.iter().map(|s| s.slot).collect();
        if ids.len() > 1 {
            batch.tables.hold(&slots, &ids, &self.stream)?;
        }
        let seqs = match ids.as_slice() {
            [one] => StepSeqs::Slot(&slots[*one]),
            _ => StepSeqs::Batch(&batch.tables, ids.len()),
        };
        // The step truncated after `limit` launches: microseconds per replay, launch names.
        let replay = |limit: usize| -> Result<(f64, Vec<&'static str>)> {
            self.prefix.begin(limit)?;
            let graph = self.capture_step(seqs, StepEnd::Greedy);
            let names = self.prefix.end()?;
            let graph = graph?;
            graph.launch()?;
            let start = PartTimer::event(&self.stream)?;
            for _ in 0..reps {
                graph.launch()?;
            }
            let end = PartTimer::event(&self.stream)?;
            Ok((start.elapsed_ms(&end)? as f64 * 1e3 / reps as f64, names))
        };
        let result = (|| {
            let (full, names) = replay(usize::MAX)?;
            let mut cumulative = Vec::with_capacity(names.len());
            for limit in 1..names.len() {
                cumulative.push(replay(limit)?.0);
            }
            cumulative.push(full);
            Ok((kernel_shares(&names, &cumulative), full))
        })();
        self.prefix.end()?;
        for state in states.iter_mut() {
            state.position += reps + 1;
            state.device_token = None;
        }
        result
    }
}

/// The trace buffer's layout (common.cuh's `BlockTrace`): a header of 8 words (word 0: records
/// written), then 5 words per record.
pub(super) const TRACE_HEADER_WORDS: usize = 8;
pub(super) const TRACE_RECORD_WORDS: usize = 5;

/// One traced block of a replayed decode step (`CudaBackend::decode_trace`); times in
/// nanoseconds from the earliest block's start.
#[derive(Clone, Debug)]
pub struct BlockRecord {
    pub launch: usize,
    pub name: &'static str,
    pub block: u32,
    pub sm: u32,
    pub start_ns: i64,
    pub waited_ns: Option<i64>,
    pub end_ns: i64,
}

impl CudaBackend {
    /// Replays the greedy decode step of `state`'s slot `warmup` times, then once more with every
    /// traced kernel's blocks recording when they started, passed their wait and exited
    /// (compiled in by `LILY_TRACE_RECORDS`). Advances the slot `warmup + 1` positions.
    pub fn decode_trace(&self, state: &mut CudaState, warmup: usize) -> Result<Vec<BlockRecord>> {
        let Some(buf) = self.k.block_trace.as_ref() else {
            anyhow::bail!("block tracing is compiled in only with LILY_TRACE_RECORDS set");
        };
        ensure!(
            state.position + warmup + 1 < self.max_context,
            "tracing advances the sequence past the context limit of {}",
            self.max_context
        );
        let slots = self.lock_slots()?;
        let slot = &slots[state.slot];
        self.prefix.begin(usize::MAX)?;
        let graph = self.capture_step(StepSeqs::Slot(slot), StepEnd::Greedy);
        let names = self.prefix.end()?;
        let graph = graph?;
        for _ in 0..warmup {
            graph.launch()?;
        }
        let mut buf = buf
            .lock()
            .map_err(|_| anyhow::anyhow!("trace lock poisoned"))?;
        self.stream.memcpy_htod(&[0], &mut buf.slice_mut(0..1))?;
        graph.launch()?;
        self.stream.synchronize()?;
        drop(slots);
        state.position += warmup + 1;
        state.device_token = None;
        let words = self.stream.clone_dtoh(&*buf)?;
        block_records(&words, &names)
    }
}

/// Decodes the trace buffer (each record: grid id, SM << 32 | block, start, end of wait or 0,
/// exit): a launch is a grid id, and grid ids grow
/// in launch order. Every launch of the step must be traced, so that there are as many grids as
/// `names`.
fn block_records(words: &[u64], names: &[&'static str]) -> Result<Vec<BlockRecord>> {
    let capacity = (words.len() - TRACE_HEADER_WORDS) / TRACE_RECORD_WORDS;
    let written = words[0] as usize;
    ensure!(
        written <= capacity,
        "the step wrote {written} block records, more than the {capacity} of LILY_TRACE_RECORDS"
    );
    let raw: Vec<&[u64]> = words[TRACE_HEADER_WORDS..]
        .chunks(TRACE_RECORD_WORDS)
        .take(written)
        .collect();
    let mut grids: Vec<u64> = raw.iter().map(|r| r[0]).collect();
    grids.sort_unstable();
    grids.dedup();
    ensure!(
        grids.len() == names.len(),
        "{} traced grids for the step's {} launches: a launched kernel is not traced",
        grids.len(),
        names.len()
    );
    let origin = raw.iter().map(|r| r[2]).min().unwrap_or(0) as i64;
    let mut records: Vec<BlockRecord> = raw
        .iter()
        .map(|r| {
            let launch = grids.partition_point(|&g| g < r[0]);
            BlockRecord {
                launch,
                name: names[launch],
                block: r[1] as u32,
                sm: (r[1] >> 32) as u32,
                start_ns: r[2] as i64 - origin,
                waited_ns: (r[3] != 0).then(|| r[3] as i64 - origin),
                end_ns: r[4] as i64 - origin,
            }
        })
        .collect();
    records.sort_by_key(|r| (r.launch, r.block));
    Ok(records)
}

/// Each kernel's share, in order of first launch, from the launches' names and the replayed
/// step's time (us) when truncated after each of them.
fn kernel_shares(names: &[&'static str], cumulative_us: &[f64]) -> Vec<KernelShare> {
    let mut shares: Vec<KernelShare> = Vec::new();
    let mut before = 0.0;
    for (&name, &now) in names.iter().zip(cumulative_us) {
        let at = match shares.iter().position(|s| s.name == name) {
            Some(at) => at,
            None => {
                shares.push(KernelShare {
                    name,
                    launches: 0,
                    critical_us: 0.0,
                });
                shares.len() - 1
            }
        };
        shares[at].launches += 1;
        shares[at].critical_us += now - before;
        before = now;
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recording_keeps_the_launches_within_its_limit_and_names_them_all() {
        let prefix = LaunchPrefix::default();
        assert!(
            prefix.admit("outside").unwrap(),
            "no recording: every launch runs"
        );
        prefix.begin(2).unwrap();
        let admitted: Vec<bool> = ["a", "b", "c"]
            .iter()
            .map(|n| prefix.admit(n).unwrap())
            .collect();
        assert_eq!(admitted, [true, true, false]);
        assert_eq!(prefix.end().unwrap(), ["a", "b", "c"]);
        assert!(prefix.admit("after").unwrap());
        assert!(
            prefix.end().unwrap().is_empty(),
            "launches outside a recording are not named"
        );
    }

    #[test]
    fn trace_records_are_grouped_into_launches_by_grid_id() {
        let mut words = vec![0u64; 8];
        // Two blocks of grid 9 (the second launch), one of grid 4 (the first), out of order.
        for r in [
            [9, (3 << 32) | 1, 150, 0, 400],
            [4, 7 << 32, 100, 120, 200],
            [9, 5 << 32, 160, 210, 300],
        ] {
            words.extend(r);
        }
        words[0] = 3;
        words.extend([0; 5]);
        let records = block_records(&words, &["first", "second"]).unwrap();
        let got: Vec<_> = records
            .iter()
            .map(|r| {
                (
                    r.launch,
                    r.name,
                    r.block,
                    r.sm,
                    r.start_ns,
                    r.waited_ns,
                    r.end_ns,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (0, "first", 0, 7, 0, Some(20), 100),
                (1, "second", 0, 5, 60, Some(110), 200),
                (1, "second", 1, 3, 50, None, 300),
            ]
        );
        let err = block_records(&words, &["first", "second", "third"]).unwrap_err();
        assert!(err.to_string().contains("not traced"), "{err}");
        words[0] = 5;
        let err = block_records(&words, &["first", "second"]).unwrap_err();
        assert!(err.to_string().contains("LILY_TRACE_RECORDS"), "{err}");
    }

    #[test]
    fn shares_add_each_launch_growth_of_the_step_to_its_kernel() {
        let names = ["embed", "matvec", "moe", "matvec", "argmax"];
        let cumulative = [2.0, 7.0, 10.0, 16.0, 15.5];
        let shares = kernel_shares(&names, &cumulative);
        let got: Vec<(&str, usize, f64)> = shares
            .iter()
            .map(|s| (s.name, s.launches, s.critical_us))
            .collect();
        assert_eq!(
            got,
            [
                ("embed", 1, 2.0),
                ("matvec", 2, 5.0 + 6.0),
                ("moe", 1, 3.0),
                ("argmax", 1, -0.5)
            ]
        );
        // The shares add up to the full step.
        let total: f64 = shares.iter().map(|s| s.critical_us).sum();
        assert_eq!(total, 15.5);
    }
}
