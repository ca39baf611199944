//! Suppressions applied to report groups (the matcher is shared with the library).
use crate::model::Group;

pub use leaktrace_common::Suppressions;

/// Every function, file and module name of a group's stack.
fn names(group: &Group) -> impl Iterator<Item = &str> + Clone {
    group.stack.iter().flat_map(|f| [f.function.as_deref(), f.file.as_deref(), f.module.as_deref()].into_iter().flatten())
}

/// LeakSanitizer's semantics over one report's groups: which are suppressed, the
/// indirect leaks each keeps that hang from a suppressed leak, and the patterns used.
pub fn apply(s: &Suppressions, groups: &[Group]) -> leaktrace_common::suppressions::Applied {
    let from: Vec<Vec<(u32, u64, u64)>> = groups.iter().map(|g| g.indirect_from.iter().map(|f| (f.stack_id, f.bytes, f.blocks)).collect()).collect();
    let candidates: Vec<leaktrace_common::suppressions::Candidate> = groups
        .iter()
        .zip(&from)
        .map(|(g, from)| leaktrace_common::suppressions::Candidate {
            stack_id: g.stack_id,
            names: names(g).collect(),
            leaked: match g.reachability {
                Some(r) => (r.definite.bytes.saturating_add(r.indirect.bytes), r.definite.blocks.saturating_add(r.indirect.blocks)),
                None => (g.bytes, g.blocks),
            },
            indirect_from: from,
        })
        .collect();
    s.apply(&candidates)
}

/// The first pattern that suppresses this group, if any.
pub fn matching<'a>(s: &'a Suppressions, group: &Group) -> Option<&'a str> {
    s.matching(names(group))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Frame;

    #[test]
    fn matches_function_file_or_module() {
        let g = Group {
            stack: vec![Frame {
                function: Some("make_layer".into()),
                file: Some("/src/net.c".into()),
                module: Some("/usr/lib/libnet.so".into()),
                ..Default::default()
            }],
            ..Default::default()
        };
        for pat in ["make_layer", "^/src/net.c$", "libnet.so", "make_*"] {
            let s = Suppressions { patterns: vec![pat.into()] };
            assert_eq!(matching(&s, &g), Some(pat));
        }
        let none = Suppressions { patterns: vec!["other".into()] };
        assert_eq!(matching(&none, &g), None);
    }
}
