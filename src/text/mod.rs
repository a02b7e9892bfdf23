//! Text in and out of the model: tokenizer, streaming detokenisation and chat templates.

pub mod chat_template;
pub mod tokenizer;
