//! transformers compiles chat templates with its `AssistantTracker` extension, whose
//! `{% generation %}` ... `{% endgeneration %}` block marks the assistant's text (for
//! `return_assistant_tokens_mask`) and otherwise renders its body as it is; vLLM renders with
//! the same environment. Templates of models trained on assistant turns only carry the tag.
//! minijinja knows no such tag, so it becomes `if true` ... `endif`, whitespace control
//! included, before the template is compiled.

use std::borrow::Cow;

/// `source` with every `generation` and `endgeneration` tag as `if true` and `endif`.
pub(super) fn as_plain_blocks(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        let (before, tag) = rest.split_at(open + 2);
        out.push_str(before);
        // Whitespace control, then the tag's name.
        let control = tag.len() - tag.trim_start_matches(['-', '+']).len();
        let name_at = control + tag[control..].len() - tag[control..].trim_start().len();
        let (head, name) = tag.split_at(name_at);
        out.push_str(head);
        let replaced =
            [("endgeneration", "endif"), ("generation", "if true")].into_iter().find(|(keyword, _)| {
                name.strip_prefix(keyword).is_some_and(|after| {
                    after.starts_with(|c: char| c.is_whitespace() || matches!(c, '-' | '+' | '%'))
                })
            });
        rest = match replaced {
            Some((keyword, plain)) => {
                out.push_str(plain);
                &name[keyword.len()..]
            }
            None => name,
        };
    }
    out.push_str(rest);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_plain_blocks_and_nothing_else_changes() {
        let source = "{%- for m in messages %}{% if m.role == 'assistant' %}{%- generation -%}\
                      {{ m.content }}{%+ endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor -%}\
                      {% set generation_prompt = 1 %}{{ 'generation' }}{%generation%}x{%endgeneration%}";
        assert_eq!(
            as_plain_blocks(source),
            "{%- for m in messages %}{% if m.role == 'assistant' %}{%- if true -%}\
             {{ m.content }}{%+ endif %}{% else %}{{ m.content }}{% endif %}{% endfor -%}\
             {% set generation_prompt = 1 %}{{ 'generation' }}{%if true%}x{%endif%}"
        );
        let plain = "{% for m in messages %}{{ m.content }}{% endfor %}";
        assert!(matches!(as_plain_blocks(plain), Cow::Borrowed(_)));
    }
}
