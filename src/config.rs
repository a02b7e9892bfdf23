//! Model configuration: `config.json` parsed into the hyper-parameters and layer plan.
