//! The block-hash chain against vectors computed independently (Python `xxhash`, see
//! `data/make_hash_vectors.py`), and its prefix property under random inputs.

use kvroute_proto::hash::{CacheNamespace, block_hash, chain, full_blocks};
use proptest::prelude::*;
use serde_json::Value;

fn ns(case: &Value) -> CacheNamespace {
    let mut ns = CacheNamespace::new(case["model"].as_str().unwrap());
    if let Some(l) = case.get("lora").and_then(Value::as_str) {
        ns = ns.with_lora(l);
    }
    if let Some(s) = case.get("salt").and_then(Value::as_str) {
        ns = ns.with_salt(s);
    }
    ns
}

#[test]
fn matches_checked_in_vectors() {
    let cases: Vec<Value> = serde_json::from_str(include_str!("data/hash-vectors.json")).unwrap();
    assert!(cases.len() >= 9);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let ns = ns(case);
        let expected_root: u64 = case["root"].as_str().unwrap().parse().unwrap();
        assert_eq!(ns.root().0, expected_root, "root of {name}");
        let tokens: Vec<u32> =
            case["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let block_size = case["block_size"].as_u64().unwrap() as usize;
        let got: Vec<u64> = ns.chain(&tokens, block_size).into_iter().map(|h| h.0).collect();
        let want: Vec<u64> =
            case["hashes"].as_array().unwrap().iter().map(|h| h.as_str().unwrap().parse().unwrap()).collect();
        assert_eq!(got, want, "chain of {name}");
    }
}

/// Two token sequences with a common prefix of `common` tokens.
fn diverging_pair() -> impl Strategy<Value = (Vec<u32>, Vec<u32>, usize)> {
    (1usize..9, 0usize..80, 0usize..40, 0usize..40).prop_flat_map(|(bs, common, a_tail, b_tail)| {
        (
            proptest::collection::vec(any::<u32>(), common),
            proptest::collection::vec(any::<u32>(), a_tail),
            proptest::collection::vec(any::<u32>(), b_tail),
            Just(bs),
        )
            .prop_map(|(prefix, mut a_tail, mut b_tail, bs)| {
                // Make the sequences really diverge right after the common prefix.
                if let (Some(a0), Some(b0)) = (a_tail.first_mut(), b_tail.first_mut())
                    && a0 == b0
                {
                    *b0 = a0.wrapping_add(1);
                }
                let mut a = prefix.clone();
                a.append(&mut a_tail);
                let mut b = prefix;
                b.append(&mut b_tail);
                (a, b, bs)
            })
    })
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Two sequences share exactly their common full-block prefix of hashes.
    #[test]
    fn shares_exactly_the_common_full_block_prefix((a, b, bs) in diverging_pair()) {
        let root = CacheNamespace::new("m").root();
        let ha = chain(root, &a, bs);
        let hb = chain(root, &b, bs);
        prop_assert_eq!(ha.len(), full_blocks(a.len(), bs));
        prop_assert_eq!(hb.len(), full_blocks(b.len(), bs));
        let shared_blocks = common_prefix(&a, &b) / bs;
        let shared_hashes = ha.iter().zip(&hb).take_while(|(x, y)| x == y).count();
        prop_assert_eq!(shared_hashes, shared_blocks.min(ha.len()).min(hb.len()));
        // After the first differing block, no later hash matches at any position either.
        for x in &ha[shared_hashes..] {
            prop_assert!(!hb[shared_hashes..].contains(x));
        }
    }

    /// Different namespaces never share a block, even for identical tokens.
    #[test]
    fn namespaces_never_share_blocks(tokens in proptest::collection::vec(any::<u32>(), 4..64), salt in "[a-z]{1,8}") {
        let plain = CacheNamespace::new("m").chain(&tokens, 4);
        let salted = CacheNamespace::new("m").with_salt(salt).chain(&tokens, 4);
        for h in &salted {
            prop_assert!(!plain.contains(h));
        }
    }

    /// Chaining in pieces equals chaining at once: a replica can extend a cached prefix.
    #[test]
    fn chain_extends_from_any_block(tokens in proptest::collection::vec(any::<u32>(), 0..100), bs in 1usize..9, cut in 0usize..20) {
        let root = CacheNamespace::new("m").root();
        let whole = chain(root, &tokens, bs);
        let cut = cut.min(whole.len());
        let parent = if cut == 0 { root } else { whole[cut - 1] };
        let rest = chain(parent, &tokens[cut * bs..], bs);
        prop_assert_eq!(&whole[cut..], &rest[..]);
        if let Some(first) = rest.first() {
            prop_assert_eq!(*first, block_hash(parent, &tokens[cut * bs..(cut + 1) * bs]));
        }
    }
}
