//! Chat templates: the checkpoint's own Jinja template rendered with `minijinja`.

use anyhow::{Result, anyhow};
use minijinja::Environment;

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Loads the template a checkpoint directory carries (`chat_template.jinja`).
    pub fn from_model_dir(dir: &std::path::Path) -> Result<Self> {
        let path = dir.join("chat_template.jinja");
        let source =
            std::fs::read_to_string(&path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Self::from_source(&source)
    }

    /// Compiles a template from its source text.
    pub fn from_source(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| anyhow!("chat template: {e}"))?;
        Ok(Self { env })
    }

    /// Renders the template with `context` (an object holding `messages` and any other variable).
    pub fn render(&self, context: &serde_json::Value) -> Result<String> {
        let tmpl = self.env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
        tmpl.render(minijinja::value::Serde(context))
            .map_err(|e| anyhow!("chat template: {e}"))
    }
}
