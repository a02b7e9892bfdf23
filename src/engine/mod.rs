//! The engine: sampling, stop conditions and the generation loop over a backend.

pub mod generate;
pub mod sampler;
pub mod scheduler;
pub mod stop;
