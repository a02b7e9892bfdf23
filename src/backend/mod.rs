//! Backends that execute the model: each implements prefill and decode.
