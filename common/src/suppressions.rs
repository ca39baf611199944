//! LeakSanitizer-compatible suppressions, shared by the preload library (its exit
//! summary) and the `leaktrace` command: one `leak:PATTERN` per line, `#` comments,
//! blank lines ignored. A pattern matches a function, source file or module name; `*`
//! matches any run of characters, `^` anchors the start and `$` the end, otherwise the
//! pattern may match anywhere (as in LSan).
use crate::report_schema::Group;

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Suppressions {
    pub patterns: Vec<String>,
}

/// Leaks that widely used libraries make on their own in every process that loads them,
/// applied after the user's patterns unless turned off (`--no-default-suppressions`,
/// `LEAKTRACE_DEFAULT_SUPPRESSIONS=0`), as valgrind's default suppressions are. An entry
/// is a block that LeakSanitizer reports as a direct leak too, that the program cannot
/// free, and whose pattern names nothing else: the function that makes it, anchored.
pub const BUILT_IN: &str = "\
# PyTorch's CUDA library (libtorch_cuda.so, in every CUDA wheel, also on machines without a
# GPU): a static initializer of CachingHostAllocator.cpp allocates 24 bytes with `new` and
# keeps no pointer to them, so every process that imports torch leaks them once.
# LeakSanitizer: \"Direct leak of 24 byte(s) in 1 object(s)\" from the same function (torch
# 2.15, `import torch`).
leak:^_GLOBAL__sub_I_CachingHostAllocator.cpp$
# CPython 3.11 and 3.12 (`thread_PyThread_start_new_thread`) and 3.13 (`ThreadHandle_start`):
# the block a thread's start hands to the new thread (its `bootstate`), which the thread
# frees when its function returns. A daemon thread still running when the interpreter
# finalizes is ended inside CPython (`PyThread_exit_thread`) and never frees it: 32 bytes
# (48 on 3.13) for each such thread, in every process that exits with one (a DataLoader
# worker's queue thread, tqdm's monitor). LeakSanitizer: \"Direct leak of 128 byte(s) in 4
# object(s)\" from the same function, for four daemon threads (3.11.7, 3.12.1, 3.13.0).
leak:^thread_PyThread_start_new_thread$
leak:^ThreadHandle_start$
";

impl Suppressions {
    /// Parses a suppressions file; `origin` names it in error messages.
    pub fn parse(text: &str, origin: &str) -> Result<Suppressions, String> {
        let mut patterns = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            match line.split_once(':') {
                Some(("leak", pat)) if !pat.trim().is_empty() => patterns.push(pat.trim().to_string()),
                Some((kind, _)) if !kind.contains(' ') && kind != "leak" => {
                    return Err(format!("{origin}:{}: unsupported suppression type \"{kind}\"; leaktrace understands leak:PATTERN lines", i + 1))
                }
                _ => return Err(format!("{origin}:{}: expected leak:PATTERN, found {line:?}", i + 1)),
            }
        }
        Ok(Suppressions { patterns })
    }

    /// The built-in list (`BUILT_IN`).
    pub fn built_in() -> Suppressions {
        // A test checks that it parses; nothing here may panic inside a host process.
        Suppressions::parse(BUILT_IN, "built-in suppressions").unwrap_or_default()
    }

    /// These patterns, followed by the built-in ones when `defaults` holds (a pattern
    /// given twice counts once, under the first).
    pub fn with_built_in(mut self, defaults: bool) -> Suppressions {
        if defaults {
            for p in Suppressions::built_in().patterns {
                if !self.patterns.contains(&p) {
                    self.patterns.push(p);
                }
            }
        }
        self
    }

    pub fn load(path: &std::path::Path) -> Result<Suppressions, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read suppressions file {} ({e}); check the path", path.display()))?;
        Suppressions::parse(&text, &path.display().to_string())
    }

    /// The first pattern matching any of `names` (the function, file and module names
    /// of every frame of one stack).
    pub fn matching<'a, 'b>(&'a self, names: impl Iterator<Item = &'b str> + Clone) -> Option<&'a str> {
        let compiled = self.compiled();
        compiled.iter().position(|p| names.clone().any(|n| p.matches(n))).map(|i| self.patterns[i].as_str())
    }

    fn compiled(&self) -> Vec<Template> {
        self.patterns.iter().map(|p| Template::new(p)).collect()
    }
}

/// One leak group as suppressions see it.
pub struct Candidate<'a> {
    pub stack_id: u32,
    /// Function, file and module names of every frame of its stack.
    pub names: Vec<&'a str>,
    /// Leaked (definite + indirect) bytes and blocks, or everything outstanding when no
    /// scan ran.
    pub leaked: (u64, u64),
    /// Its indirect leaks by the stack of the definite leak each hangs from:
    /// `(stack_id, bytes, blocks)`.
    pub indirect_from: &'a [(u32, u64, u64)],
}

/// A pattern that matched, as LeakSanitizer's "Suppressions used:" table shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Used {
    pub pattern: String,
    /// Allocations suppressed.
    pub count: u64,
    pub bytes: u64,
}

/// What suppressions do to a set of groups.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Per group: suppressed whole.
    pub suppressed: Vec<bool>,
    /// Per group (not suppressed itself): indirect bytes and blocks hidden because they
    /// hang from a suppressed leak.
    pub hidden_indirect: Vec<(u64, u64)>,
    /// The patterns that matched, in file order.
    pub used: Vec<Used>,
}

impl Suppressions {
    /// LeakSanitizer's semantics: a group whose stack matches a pattern is suppressed,
    /// and so are the indirect leaks that hang from it (in whatever group they are).
    pub fn apply(&self, groups: &[Candidate]) -> Applied {
        let mut out = Applied { suppressed: vec![false; groups.len()], hidden_indirect: vec![(0, 0); groups.len()], used: Vec::new() };
        // (Not a std HashMap: its hasher would cost a `getrandom` call in every process.)
        let mut by_stack: std::collections::BTreeMap<u32, usize> = std::collections::BTreeMap::new();
        let mut tally = vec![(0u64, 0u64); self.patterns.len()];
        let compiled = self.compiled();
        for (i, g) in groups.iter().enumerate() {
            let hit = compiled.iter().position(|p| g.names.iter().any(|n| p.matches(n)));
            if let Some(p) = hit {
                out.suppressed[i] = true;
                by_stack.insert(g.stack_id, p);
                tally[p].0 += g.leaked.1;
                tally[p].1 += g.leaked.0;
            }
        }
        for (i, g) in groups.iter().enumerate() {
            if out.suppressed[i] {
                continue;
            }
            for &(owner, bytes, blocks) in g.indirect_from {
                if let Some(&p) = by_stack.get(&owner) {
                    out.hidden_indirect[i].0 += bytes;
                    out.hidden_indirect[i].1 += blocks;
                    tally[p].0 += blocks;
                    tally[p].1 += bytes;
                }
            }
        }
        for (p, (count, bytes)) in self.patterns.iter().zip(tally) {
            if count > 0 || bytes > 0 {
                out.used.push(Used { pattern: p.clone(), count, bytes });
            }
        }
        out
    }
}

impl Suppressions {
    /// `apply` to a report's leak groups: the library's exit summary and the command's
    /// reports see the same groups the same way.
    pub fn apply_to_groups(&self, groups: &[Group]) -> Applied {
        let from: Vec<Vec<(u32, u64, u64)>> = groups.iter().map(|g| g.indirect_from.iter().map(|f| (f.stack_id, f.bytes, f.blocks)).collect()).collect();
        let candidates: Vec<Candidate> = groups
            .iter()
            .zip(&from)
            .map(|(g, from)| {
                let leaked = g.leaked();
                Candidate { stack_id: g.stack_id, names: group_names(g).collect(), leaked: (leaked.bytes, leaked.blocks), indirect_from: from }
            })
            .collect();
        self.apply(&candidates)
    }

    /// The first pattern that suppresses `group`, if any.
    pub fn matching_group(&self, group: &Group) -> Option<&str> {
        self.matching(group_names(group))
    }
}

/// Every function, file and module name of a group's stack: what patterns match.
pub fn group_names(group: &Group) -> impl Iterator<Item = &str> + Clone {
    frame_names(&group.stack)
}

/// Every function, file and module name of `stack`'s frames.
pub fn frame_names(stack: &[crate::report_schema::Frame]) -> impl Iterator<Item = &str> + Clone {
    stack.iter().flat_map(|f| [f.function.as_deref(), f.file.as_deref(), f.module.as_deref()].into_iter().flatten())
}

/// LeakSanitizer's table of the suppressions that matched, or "" when none did.
pub fn used_table(used: &[Used]) -> String {
    if used.is_empty() {
        return String::new();
    }
    let rule = "-----------------------------------------------------\n";
    let mut s = String::from(rule);
    s.push_str("Suppressions used:\n");
    s.push_str("  count      bytes template\n");
    for u in used {
        s.push_str(&format!("{:>7} {:>10} {}\n", u.count, u.bytes, u.pattern));
    }
    s.push_str(rule);
    let built_in = Suppressions::built_in();
    if used.iter().any(|u| built_in.patterns.contains(&u.pattern)) {
        s.push_str(BUILT_IN_NOTE);
        s.push('\n');
    }
    s
}

/// Said under a table that holds a built-in pattern.
pub const BUILT_IN_NOTE: &str =
    "(built-in templates: leaks that PyTorch and CPython make on their own; --no-default-suppressions or LEAKTRACE_DEFAULT_SUPPRESSIONS=0 counts them)";

/// LSan's template match: `*` wildcard, optional `^`/`$` anchors, unanchored otherwise.
pub fn template_match(template: &str, s: &str) -> bool {
    Template::new(template).matches(s)
}

/// A template made ready to match many names: a suppression pass matches every name of
/// every frame of every group (~900k in a torch run's final report). The common shapes
/// (`^name$`, `name`, `^prefix`, `suffix$`) are plain string comparisons; the rest is the
/// whole-string glob the template stands for, its unanchored ends made `*`.
enum Template {
    Exact(String),
    Contains(String),
    Prefix(String),
    Suffix(String),
    Glob(Vec<u8>),
}

impl Template {
    fn new(template: &str) -> Template {
        let (start, t) = match template.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, template),
        };
        let (end, t) = match t.strip_suffix('$') {
            Some(rest) => (true, rest),
            None => (false, t),
        };
        if t.contains('*') {
            return Template::Glob(format!("{}{t}{}", if start { "" } else { "*" }, if end { "" } else { "*" }).into_bytes());
        }
        let t = t.to_string();
        match (start, end) {
            (true, true) => Template::Exact(t),
            (true, false) => Template::Prefix(t),
            (false, true) => Template::Suffix(t),
            (false, false) => Template::Contains(t),
        }
    }

    fn matches(&self, s: &str) -> bool {
        match self {
            Template::Exact(t) => s == t,
            Template::Contains(t) => s.contains(t.as_str()),
            Template::Prefix(t) => s.starts_with(t.as_str()),
            Template::Suffix(t) => s.ends_with(t.as_str()),
            Template::Glob(p) => glob(p, s.as_bytes()),
        }
    }
}

/// Whole-string match where `*` stands for any run of bytes (iterative backtracking).
fn glob(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if pi < p.len() && p[pi] == s[si] {
            pi += 1;
            si += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_matches_by_function_file_or_module() {
        let g = Group {
            stack: vec![crate::report_schema::Frame {
                function: Some("make_layer".into()),
                file: Some("/src/net.c".into()),
                module: Some("/usr/lib/libnet.so".into()),
                ..Default::default()
            }],
            ..Default::default()
        };
        for pat in ["make_layer", "^/src/net.c$", "libnet.so", "make_*"] {
            let s = Suppressions { patterns: vec![pat.into()] };
            assert_eq!(s.matching_group(&g), Some(pat));
        }
        let none = Suppressions { patterns: vec!["other".into()] };
        assert_eq!(none.matching_group(&g), None);
    }

    fn frame(function: &str, module: &str) -> crate::report_schema::Frame {
        crate::report_schema::Frame { function: Some(function.into()), module: Some(module.into()), ..Default::default() }
    }

    #[test]
    fn the_built_in_list_parses_and_names_only_the_blocks_libraries_leak_on_their_own() {
        let built_in = Suppressions::built_in();
        assert_eq!(built_in, Suppressions::parse(BUILT_IN, "x").unwrap());
        assert!(!built_in.patterns.is_empty());
        // The block as a report has it (torch 2.15's libtorch_cuda.so).
        let torch = Group {
            stack: vec![
                frame("operator new(unsigned long)", "/lib/x86_64-linux-gnu/libstdc++.so.6"),
                frame("_GLOBAL__sub_I_CachingHostAllocator.cpp", "/venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so"),
                frame("dlopen", "/lib/x86_64-linux-gnu/libc.so.6"),
            ],
            ..Default::default()
        };
        assert_eq!(built_in.matching_group(&torch), Some("^_GLOBAL__sub_I_CachingHostAllocator.cpp$"));
        // Other static initializers, of torch or of the program, and other allocations
        // of the same library are not suppressed.
        for other in ["_GLOBAL__sub_I_CachingHostAllocator.cpp.123", "_GLOBAL__sub_I_my_code.cpp", "at::cuda::CachingHostAllocator::allocate"] {
            let g = Group { stack: vec![frame(other, "/site-packages/torch/lib/libtorch_cuda.so")], ..Default::default() };
            assert_eq!(built_in.matching_group(&g), None, "{other}");
        }
        // CPython's thread start, as reports have it (3.11 and 3.13), and not the code
        // the thread runs nor other functions of the module.
        for (function, pattern) in [("thread_PyThread_start_new_thread", "^thread_PyThread_start_new_thread$"), ("ThreadHandle_start", "^ThreadHandle_start$")]
        {
            let g = Group { stack: vec![frame(function, "/usr/lib/libpython3.so"), frame("cfunction_call", "/usr/lib/libpython3.so")], ..Default::default() };
            assert_eq!(built_in.matching_group(&g), Some(pattern));
        }
        for other in ["thread_run", "t_bootstrap", "thread_PyThread_start_new_thread_ex", "PyThread_start_new_thread"] {
            let g = Group { stack: vec![frame("malloc", "libc.so.6"), frame(other, "/usr/lib/libpython3.so")], ..Default::default() };
            assert_eq!(built_in.matching_group(&g), None, "{other}");
        }
        // After the user's own patterns, each once; or not at all.
        let mine = Suppressions { patterns: vec!["mine".into(), built_in.patterns[0].clone()] };
        assert_eq!(mine.clone().with_built_in(true).patterns.len(), 1 + built_in.patterns.len());
        assert_eq!(mine.clone().with_built_in(true).patterns[0], "mine");
        assert_eq!(mine.clone().with_built_in(false), mine);
        // The table says where a built-in template comes from and how to count it.
        let used = [Used { pattern: built_in.patterns[0].clone(), count: 1, bytes: 24 }];
        assert!(used_table(&used).ends_with(&format!("{BUILT_IN_NOTE}\n")));
        assert!(!used_table(&[Used { pattern: "mine".into(), count: 1, bytes: 24 }]).contains(BUILT_IN_NOTE));
    }

    #[test]
    fn lsan_template_semantics() {
        assert!(template_match("leak_me", "app::leak_me()"));
        assert!(template_match("^app::", "app::leak_me()"));
        assert!(!template_match("^leak", "app::leak_me()"));
        assert!(template_match("leak_me()$", "app::leak_me()"));
        assert!(!template_match("leak_me$", "app::leak_me()"));
        assert!(template_match("app*me", "app::leak_me()"));
        assert!(template_match("^app*()$", "app::leak_me()"));
        assert!(!template_match("^app*x$", "app::leak_me()"));
        assert!(template_match("*", "anything"));
        assert!(template_match("libstdc++*", "/usr/lib/libstdc++.so.6"));
        assert!(template_match("^$", ""));
        assert!(!template_match("^$", "x"));
    }

    #[test]
    fn every_template_shape_matches_as_the_glob_it_stands_for() {
        // The plain comparisons of `Template` against the whole-string glob of the
        // template with its unanchored ends made `*`, on names that put the literal at
        // the start, the end, the middle, twice, or nowhere.
        let reference = |template: &str, s: &str| {
            let (start, t) = template.strip_prefix('^').map_or((false, template), |r| (true, r));
            let (end, t) = t.strip_suffix('$').map_or((false, t), |r| (true, r));
            glob(format!("{}{t}{}", if start { "" } else { "*" }, if end { "" } else { "*" }).as_bytes(), s.as_bytes())
        };
        let names = ["", "a", "ab", "ba", "bab", "abab", "xaby", "ab$", "^ab", "a*b", "_PyObject_Malloc", "train.py", "/w/train.py"];
        for body in ["", "a", "ab", "b", "a*b", "*", "train.py", "Malloc", "_Py*Malloc"] {
            for template in [body.to_string(), format!("^{body}"), format!("{body}$"), format!("^{body}$")] {
                for name in names {
                    assert_eq!(template_match(&template, name), reference(&template, name), "{template:?} on {name:?}");
                }
            }
        }
    }

    #[test]
    fn parses_lsan_files_and_rejects_other_types() {
        let s = Suppressions::parse("# comment\n\nleak:foo\n  leak:^bar$  \n", "s.txt").unwrap();
        assert_eq!(s.patterns, vec!["foo", "^bar$"]);
        assert!(Suppressions::parse("race:foo", "s.txt").unwrap_err().contains("s.txt:1: unsupported suppression type \"race\""));
        assert!(Suppressions::parse("leak:", "s.txt").unwrap_err().contains("expected leak:PATTERN"));
        assert!(Suppressions::parse("foo bar", "s.txt").is_err());
    }

    #[test]
    fn a_suppressed_leak_hides_the_indirect_leaks_that_hang_from_it() {
        let s = Suppressions { patterns: vec!["unused".into(), "make_tree".into()] };
        // Group 0: the tree's root (definite, suppressed); group 1: its nodes (indirect,
        // owned by stack 7, plus 100 bytes owned by an unsuppressed leak at stack 9);
        // group 2: that other leak.
        let from = [(7, 300, 3), (9, 100, 1)];
        let groups = [
            Candidate { stack_id: 7, names: vec!["make_tree", "main"], leaked: (50, 1), indirect_from: &[] },
            Candidate { stack_id: 8, names: vec!["make_node", "main"], leaked: (400, 4), indirect_from: &from },
            Candidate { stack_id: 9, names: vec!["other", "main"], leaked: (10, 1), indirect_from: &[] },
        ];
        let a = s.apply(&groups);
        assert_eq!(a.suppressed, vec![true, false, false]);
        assert_eq!(a.hidden_indirect, vec![(0, 0), (300, 3), (0, 0)]);
        assert_eq!(a.used, vec![Used { pattern: "make_tree".into(), count: 4, bytes: 350 }]);
        let table = used_table(&a.used);
        assert!(table.contains("Suppressions used:\n  count      bytes template\n      4        350 make_tree\n"), "{table}");
        assert_eq!(used_table(&[]), "");
    }

    #[test]
    fn first_matching_pattern_over_all_names() {
        let s = Suppressions { patterns: vec!["nope".into(), "make_*".into()] };
        let names = ["/src/net.c", "make_layer", "/usr/lib/libnet.so"];
        assert_eq!(s.matching(names.iter().copied()), Some("make_*"));
        assert_eq!(s.matching(["other"].iter().copied()), None);
    }
}
