//! LeakSanitizer-compatible suppressions, shared by the preload library (its exit
//! summary) and the `leaktrace` command: one `leak:PATTERN` per line, `#` comments,
//! blank lines ignored. A pattern matches a function, source file or module name; `*`
//! matches any run of characters, `^` anchors the start and `$` the end, otherwise the
//! pattern may match anywhere (as in LSan).

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Suppressions {
    pub patterns: Vec<String>,
}

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
                    return Err(format!(
                        "{origin}:{}: unsupported suppression type \"{kind}\"; leaktrace understands leak:PATTERN lines",
                        i + 1
                    ))
                }
                _ => return Err(format!("{origin}:{}: expected leak:PATTERN, found {line:?}", i + 1)),
            }
        }
        Ok(Suppressions { patterns })
    }

    pub fn load(path: &std::path::Path) -> Result<Suppressions, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read suppressions file {} ({e}); check the path", path.display()))?;
        Suppressions::parse(&text, &path.display().to_string())
    }

    /// The first pattern matching any of `names` (the function, file and module names
    /// of every frame of one stack).
    pub fn matching<'a, 'b>(&'a self, names: impl Iterator<Item = &'b str> + Clone) -> Option<&'a str> {
        self.patterns.iter().map(String::as_str).find(|p| names.clone().any(|n| template_match(p, n)))
    }
}

/// LSan's template match: `*` wildcard, optional `^`/`$` anchors, unanchored otherwise.
pub fn template_match(template: &str, s: &str) -> bool {
    let (start, t) = match template.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, template),
    };
    let (end, t) = match t.strip_suffix('$') {
        Some(rest) => (true, rest),
        None => (false, t),
    };
    let pattern = format!("{}{t}{}", if start { "" } else { "*" }, if end { "" } else { "*" });
    glob(pattern.as_bytes(), s.as_bytes())
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
    fn parses_lsan_files_and_rejects_other_types() {
        let s = Suppressions::parse("# comment\n\nleak:foo\n  leak:^bar$  \n", "s.txt").unwrap();
        assert_eq!(s.patterns, vec!["foo", "^bar$"]);
        assert!(Suppressions::parse("race:foo", "s.txt").unwrap_err().contains("s.txt:1: unsupported suppression type \"race\""));
        assert!(Suppressions::parse("leak:", "s.txt").unwrap_err().contains("expected leak:PATTERN"));
        assert!(Suppressions::parse("foo bar", "s.txt").is_err());
    }

    #[test]
    fn first_matching_pattern_over_all_names() {
        let s = Suppressions { patterns: vec!["nope".into(), "make_*".into()] };
        let names = ["/src/net.c", "make_layer", "/usr/lib/libnet.so"];
        assert_eq!(s.matching(names.iter().copied()), Some("make_*"));
        assert_eq!(s.matching(["other"].iter().copied()), None);
    }
}
