//! The checkpoint manifest parser on arbitrary bytes: a manifest or a typed error, never a
//! panic; a parsed manifest writes back to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lowbit_ckpt::{CkptError, Manifest};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let file = std::path::Path::new("manifest.json");
    match Manifest::parse(file, text) {
        Ok(m) => {
            let again = Manifest::parse(file, &m.to_json().to_text()).expect("written back");
            assert_eq!(again, m);
        }
        Err(CkptError::Manifest { .. } | CkptError::Version { .. }) => {}
        Err(other) => panic!("an error of another kind: {other:?}"),
    }
});
