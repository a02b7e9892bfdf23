//! The engine: sampling, stop conditions, the generation loop over a backend, and the scheduler
//! with its prefix cache.

pub mod constraint;
pub mod generate;
pub mod prefix_cache;
pub mod sampler;
pub mod scheduler;
pub mod stop;
