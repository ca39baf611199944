//! Suppressions applied to report groups (the matcher is shared with the library).
use crate::model::Group;

pub use leaktrace_common::Suppressions;

/// Every function, file and module name of a group's stack.
fn names(group: &Group) -> impl Iterator<Item = &str> + Clone {
    group.stack.iter().flat_map(|f| [f.function.as_deref(), f.file.as_deref(), f.module.as_deref()].into_iter().flatten())
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
