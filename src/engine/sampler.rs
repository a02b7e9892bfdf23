//! Token sampling: logits processors (penalties, temperature, top-k/top-p/min-p) and seeded draws.
