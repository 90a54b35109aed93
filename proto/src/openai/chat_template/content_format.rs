//! How a chat template takes a message's `content`, decided as vLLM decides it
//! (`--chat-template-content-format auto`, `_detect_content_format` in
//! `vllm/renderers/hf.py`, 0.33): from the template's syntax tree (minijinja's here, Jinja2's
//! there), a template with a loop over a message's content takes a list of parts.
//!
//! A loop over a message's content is, as vLLM has it:
//! - `{% for x in m.content %}` (or `m['content']`, through filters, tests or a slice),
//!   where `m` is the variable of a loop over `messages`, or over a name set from it
//!   (`{% set loop_messages = messages[1:] %}`, `namespace(rest=messages)`,
//!   `{% set ns.rest = messages %}`, and names set from those);
//! - in a macro, a loop over one of its parameters that a call passes such a content to
//!   (`{% macro render(c) %}{% for p in c %}`, `render(message.content)`);
//! - outside any macro, a loop over a variable named `content`.
//!
//! A template that does not parse, or whose loop over messages (or over a content) has no
//! single variable, is taken as a string template, as vLLM's default is then.

use std::collections::{HashSet, VecDeque};

use minijinja::machinery::ast::{self, CallArg, Expr, Stmt};

/// How a template takes a message's `content`, as vLLM decides it: a template that loops
/// over a message's `content` gets a list of parts (`{"type": "text", "text": ...}`, one for
/// each text part the client sent, a string being one), any other a string (text parts
/// joined with `"\n"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContentFormat {
    String,
    OpenAi,
}

impl ContentFormat {
    /// vLLM's reading of a template's `source` (see the module docs).
    pub fn of_template(source: &str) -> Self {
        let Ok(root) = minijinja::machinery::parse(source, "chat", Default::default()) else {
            return ContentFormat::String;
        };
        let mut nodes = Nodes::default();
        nodes.stmt(&root, &mut Vec::new());
        match nodes.loops_over_content() {
            Some(true) => ContentFormat::OpenAi,
            _ => ContentFormat::String,
        }
    }
}

/// The nodes of a syntax tree the decision looks at, in the tree's order.
#[derive(Default)]
struct Nodes<'t, 'a> {
    /// Every for loop, with the macros it is in (indices into `macros`, outermost first).
    loops: Vec<(&'t ast::ForLoop<'a>, Vec<usize>)>,
    sets: Vec<&'t ast::Set<'a>>,
    macros: Vec<&'t ast::Macro<'a>>,
    calls: Vec<&'t ast::Call<'a>>,
}

impl<'t, 'a> Nodes<'t, 'a> {
    /// Whether a loop goes over a message's content; `None` where vLLM's walk fails (a loop
    /// target that is not one name).
    fn loops_over_content(&self) -> Option<bool> {
        let lists = self.aliases("messages");
        let mut messages = Vec::new();
        for (each, _) in &self.loops {
            if lists.iter().any(|list| is_var_or_elems(&each.iter, list, None)) {
                messages.push(target(each)?);
            }
        }
        let params = self.macro_content_params(&messages);
        for (each, macros) in &self.loops {
            let over = |name: &str| matches!(&each.iter, Expr::Var(v) if v.id == name);
            let content = messages.iter().any(|m| is_var_or_elems(&each.iter, m, Some("content")))
                || macros
                    .iter()
                    .rev()
                    .find_map(|&m| params[m].as_ref())
                    .is_some_and(|p| p.iter().any(|p| over(p)))
                || (macros.is_empty() && over("content"));
            if content {
                return target(each).map(|_| true);
            }
        }
        Some(false)
    }

    /// `name` and every name set from it, or from those (vLLM's
    /// `_iter_nodes_assign_var_or_elems`).
    fn aliases(&self, name: &str) -> Vec<String> {
        let mut names = vec![name.to_owned()];
        let mut seen = HashSet::from([name.to_owned()]);
        let mut queue = VecDeque::from([name.to_owned()]);
        while let Some(related) = queue.pop_front() {
            for set in &self.sets {
                let from = |e: &Expr<'_>| is_var_or_elems(e, &related, None);
                let found: Vec<String> = match (&set.target, &set.expr) {
                    (Expr::Var(lhs), rhs) if from(rhs) => vec![lhs.id.to_owned()],
                    (Expr::Var(lhs), Expr::Call(call)) if matches!(&call.expr, Expr::Var(f) if f.id == "namespace") => {
                        call.args
                            .iter()
                            .filter_map(|arg| match arg {
                                CallArg::Kwarg(key, value) if from(value) => {
                                    Some(format!("{}.{key}", lhs.id))
                                }
                                _ => None,
                            })
                            .collect()
                    }
                    (lhs @ Expr::GetAttr(_), rhs) if from(rhs) => dotted(lhs).into_iter().collect(),
                    _ => Vec::new(),
                };
                for alias in found {
                    if alias != related && seen.insert(alias.clone()) {
                        queue.push_back(alias.clone());
                    }
                    names.push(alias);
                }
            }
        }
        names
    }

    /// For each macro, the parameters a call passes a message's content to (`None` for
    /// none).
    fn macro_content_params(&self, messages: &[&str]) -> Vec<Option<Vec<&'a str>>> {
        let content = |e: &Expr<'_>| messages.iter().any(|m| is_var_or_elems(e, m, Some("content")));
        self.macros
            .iter()
            .map(|m| {
                let names: Vec<&'a str> = m
                    .args
                    .iter()
                    .filter_map(|a| match a {
                        Expr::Var(v) => Some(v.id),
                        _ => None,
                    })
                    .collect();
                let mut params = Vec::new();
                for call in self.calls.iter().filter(|c| matches!(&c.expr, Expr::Var(f) if f.id == m.name)) {
                    let positional = call.args.iter().filter_map(|a| match a {
                        CallArg::Pos(e) => Some(e),
                        _ => None,
                    });
                    for (arg, name) in positional.zip(&names) {
                        if content(arg) {
                            params.push(*name);
                        }
                    }
                    for arg in &call.args {
                        if let CallArg::Kwarg(key, value) = arg
                            && names.contains(key)
                            && content(value)
                        {
                            params.push(*key);
                        }
                    }
                }
                (!params.is_empty()).then_some(params)
            })
            .collect()
    }

    fn stmts(&mut self, stmts: &'t [Stmt<'a>], macros: &mut Vec<usize>) {
        for s in stmts {
            self.stmt(s, macros);
        }
    }

    fn stmt(&mut self, stmt: &'t Stmt<'a>, macros: &mut Vec<usize>) {
        match stmt {
            Stmt::Template(t) => self.stmts(&t.children, macros),
            Stmt::EmitExpr(e) => self.expr(&e.expr),
            Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => {}
            Stmt::ForLoop(each) => {
                self.loops.push((each, macros.clone()));
                self.expr(&each.iter);
                if let Some(filter) = &each.filter_expr {
                    self.expr(filter);
                }
                self.stmts(&each.body, macros);
                self.stmts(&each.else_body, macros);
            }
            Stmt::IfCond(cond) => {
                self.expr(&cond.expr);
                self.stmts(&cond.true_body, macros);
                self.stmts(&cond.false_body, macros);
            }
            Stmt::WithBlock(with) => {
                for (_, value) in &with.assignments {
                    self.expr(value);
                }
                self.stmts(&with.body, macros);
            }
            Stmt::Set(set) => {
                self.sets.push(set);
                self.expr(&set.expr);
            }
            Stmt::SetBlock(set) => {
                if let Some(filter) = &set.filter {
                    self.expr(filter);
                }
                self.stmts(&set.body, macros);
            }
            Stmt::AutoEscape(block) => self.stmts(&block.body, macros),
            Stmt::FilterBlock(block) => {
                self.expr(&block.filter);
                self.stmts(&block.body, macros);
            }
            Stmt::Block(block) => self.stmts(&block.body, macros),
            Stmt::Import(_) | Stmt::FromImport(_) | Stmt::Extends(_) | Stmt::Include(_) => {}
            Stmt::Macro(m) => {
                macros.push(self.macros.len());
                self.macros.push(m);
                self.exprs(&m.defaults);
                self.stmts(&m.body, macros);
                macros.pop();
            }
            // A call block's body is no macro of the template's (as in Jinja2's tree).
            Stmt::CallBlock(block) => {
                self.call(&block.call);
                self.stmts(&block.macro_decl.body, macros);
            }
            Stmt::Do(d) => self.call(&d.call),
        }
    }

    fn exprs(&mut self, exprs: &'t [Expr<'a>]) {
        for e in exprs {
            self.expr(e);
        }
    }

    fn expr(&mut self, expr: &'t Expr<'a>) {
        match expr {
            Expr::Var(_) | Expr::Const(_) => {}
            Expr::Slice(s) => {
                self.expr(&s.expr);
                for part in [&s.start, &s.stop, &s.step].into_iter().flatten() {
                    self.expr(part);
                }
            }
            Expr::UnaryOp(op) => self.expr(&op.expr),
            Expr::BinOp(op) => {
                self.expr(&op.left);
                self.expr(&op.right);
            }
            Expr::Compare(c) => {
                self.expr(&c.expr);
                for op in &c.ops {
                    self.expr(&op.expr);
                }
            }
            Expr::IfExpr(e) => {
                self.expr(&e.test_expr);
                self.expr(&e.true_expr);
                if let Some(otherwise) = &e.false_expr {
                    self.expr(otherwise);
                }
            }
            Expr::Filter(f) => {
                if let Some(e) = &f.expr {
                    self.expr(e);
                }
                self.args(&f.args);
            }
            Expr::Test(t) => {
                self.expr(&t.expr);
                self.args(&t.args);
            }
            Expr::GetAttr(g) => self.expr(&g.expr),
            Expr::GetItem(g) => {
                self.expr(&g.expr);
                self.expr(&g.subscript_expr);
            }
            Expr::Call(call) => self.call(call),
            Expr::List(l) => self.exprs(&l.items),
            Expr::Tuple(t) => self.exprs(&t.items),
            Expr::Map(m) => {
                self.exprs(&m.keys);
                self.exprs(&m.values);
            }
        }
    }

    fn call(&mut self, call: &'t ast::Call<'a>) {
        self.calls.push(call);
        self.expr(&call.expr);
        self.args(&call.args);
    }

    fn args(&mut self, args: &'t [CallArg<'a>]) {
        for arg in args {
            match arg {
                CallArg::Pos(e) | CallArg::Kwarg(_, e) | CallArg::PosSplat(e) | CallArg::KwargSplat(e) => {
                    self.expr(e)
                }
            }
        }
    }
}

/// A loop's variable, when it is one name.
fn target<'a>(each: &ast::ForLoop<'a>) -> Option<&'a str> {
    match &each.target {
        Expr::Var(v) => Some(v.id),
        _ => None,
    }
}

/// `name` (which may be dotted, `ns.rest`) read as it is (vLLM's `_is_var_access`).
fn is_var(e: &Expr<'_>, name: &str) -> bool {
    match e {
        Expr::Var(v) => v.id == name,
        Expr::GetAttr(g) => {
            name.rsplit_once('.').is_some_and(|(base, attr)| g.name == attr && is_var(&g.expr, base))
        }
        _ => false,
    }
}

/// `name.key` or `name['key']` (vLLM's `_is_attr_access`).
fn is_attr(e: &Expr<'_>, name: &str, key: &str) -> bool {
    match e {
        Expr::GetItem(g) => {
            is_var(&g.expr, name)
                && matches!(&g.subscript_expr, Expr::Const(c) if c.value.as_str() == Some(key))
        }
        Expr::GetAttr(g) => g.name == key && is_var(&g.expr, name),
        _ => false,
    }
}

/// `name` (or `name.key`), through filters, tests and slices (vLLM's
/// `_is_var_or_elems_access`).
fn is_var_or_elems(e: &Expr<'_>, name: &str, key: Option<&str>) -> bool {
    match e {
        Expr::Filter(f) => f.expr.as_ref().is_some_and(|e| is_var_or_elems(e, name, key)),
        Expr::Test(t) => is_var_or_elems(&t.expr, name, key),
        Expr::Slice(s) => is_var_or_elems(&s.expr, name, key),
        _ => match key {
            Some(key) => is_attr(e, name, key),
            None => is_var(e, name),
        },
    }
}

/// An attribute chain on a name as a dotted name (`ns.rest`).
fn dotted(e: &Expr<'_>) -> Option<String> {
    match e {
        Expr::Var(v) => Some(v.id.to_owned()),
        Expr::GetAttr(g) => Some(format!("{}.{}", dotted(&g.expr)?, g.name)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::ContentFormat::{self, OpenAi, String};

    /// Expected formats from vLLM 0.33's own `_iter_nodes_assign_content_item` over Jinja2's
    /// tree of each template (and its `except Exception: return default` for the failing one).
    #[test]
    fn formats_are_read_from_the_tree_as_vllm_reads_them() {
        let cases: [(&str, ContentFormat, &str); 11] = [
            (
                "{%- macro render(c, flag=false) %}{% if c is string %}{{ c }}{% else %}{% for item in c %}\
                 {{ item.text }}{% endfor %}{% endif %}{% endmacro %}\
                 {% for message in messages %}{{ render(message.content, true) }}{% endfor %}",
                OpenAi,
                "a macro parameter given a message's content, looped over in the macro",
            ),
            (
                "{% macro render(flag, c) %}{% for item in c %}{{ item.text }}{% endfor %}{% endmacro %}\
                 {% for m in messages %}{{ render(true, c=m['content']) }}{% endfor %}",
                OpenAi,
                "given as a keyword",
            ),
            (
                "{% macro render(c) %}{% for item in c %}{{ item.text }}{% endfor %}{% endmacro %}\
                 {{ render(messages[0].content) }}",
                String,
                "not from a loop's variable",
            ),
            (
                "{% macro render(content) %}{% for item in content %}{{ item }}{% endfor %}{% endmacro %}\
                 {% for m in messages %}{{ render(m.role) }}{% endfor %}",
                String,
                "a macro's own `content` that no call gives a content",
            ),
            (
                "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p.text }}\
                 {% endfor %}{% endfor %}",
                OpenAi,
                "a loop over `content` outside macros",
            ),
            (
                "{% set ns = namespace(rest=messages[1:]) %}{% for m in ns.rest %}{% for p in m.content %}\
                 {{ p }}{% endfor %}{% endfor %}",
                OpenAi,
                "a namespace alias",
            ),
            (
                "{% set ns = namespace(x=0) %}{% set ns.msgs = messages %}{% set kept = ns.msgs | selectattr('role') %}\
                 {% for m in kept %}{% for p in m.content | list %}{% endfor %}{% endfor %}",
                OpenAi,
                "an attribute alias, then one through a filter",
            ),
            (
                "{% for m in messages %}{% for line in m.content.split('\\n') %}{% endfor %}{% endfor %}",
                String,
                "a method call",
            ),
            (
                "{% for i, m in messages %}{% endfor %}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
                String,
                "vLLM's walk fails on a loop over messages with two variables",
            ),
            (
                "{% macro wrap() %}{{ caller() }}{% endmacro %}{% for m in messages %}{% call wrap() %}\
                 {% for p in m.content %}{% endfor %}{% endcall %}{% endfor %}",
                OpenAi,
                "in a call block",
            ),
            (
                "{% for m in messages if m.role != 'system' %}{% for p in m['content'] if p.type == 'text' %}\
                 {{ p.text }}{% endfor %}{% endfor %}",
                OpenAi,
                "loops with filters",
            ),
        ];
        for (source, format, what) in cases {
            assert_eq!(ContentFormat::of_template(source), format, "{what}: {source}");
        }
        assert_eq!(ContentFormat::of_template("{% for m in messages %}"), String, "does not parse");
    }
}
