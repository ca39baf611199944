//! The per-user directories both sides make in `/tmp` (the standby socket's, the
//! library's copy in another root): checked the same way wherever they are made.
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// Whether `dir` is a directory (not a link) owned by `uid` and open to no one else;
/// the error says what it is instead and what to do.
pub fn check(dir: &Path, uid: u32) -> Result<(), String> {
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "{} is not a directory of user {uid}'s that only it may use (owner {}, mode {:o}); remove it",
            dir.display(),
            meta.uid(),
            meta.permissions().mode() & 0o7777
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::DirBuilderExt;

    #[test]
    fn only_a_private_directory_of_the_user_passes() {
        let base = std::env::temp_dir().join(format!("leaktrace-private-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let private = base.join("private");
        std::fs::DirBuilder::new().mode(0o700).create(&private).unwrap();
        let uid = std::fs::metadata(&private).unwrap().uid();
        assert_eq!(check(&private, uid), Ok(()));
        assert!(check(&private, uid + 1).unwrap_err().contains("owner"));
        let open = base.join("open");
        std::fs::DirBuilder::new().mode(0o700).create(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(check(&open, uid).unwrap_err().contains("mode 755"));
        let link = base.join("link");
        std::os::unix::fs::symlink(&private, &link).unwrap();
        assert!(check(&link, uid).is_err(), "a link is refused");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
