//! Where prefill time goes: when enabled, the prefill path records a CUDA event at the end of each
//! part of a layer (projections, DeltaNet, attention, MoE, lm_head) and the timer sums the GPU
//! time between consecutive events per part. Off by default: recording events costs a driver call
//! each, so only `lily bench` turns it on, for a run of its own.

use anyhow::Result;
use cudarc::driver::{CudaEvent, CudaStream, sys::CUevent_flags};

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
