//! Which addresses a tenant's webhook may not reach: every entry of IANA's IPv4 and IPv6
//! Special-Purpose Address Registries, multicast, and — for IPv6 — everything outside
//! global unicast (`2000::/3`). Prefixes that carry an IPv4 address (IPv4-mapped, NAT64,
//! 6to4) are judged by the address they carry. Entries the registries mark globally
//! reachable (AS112, AMT, the anycast service addresses) are refused too: no webhook
//! receiver lives there.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// IANA's IPv4 Special-Purpose Address Registry, every entry (smaller entries inside a
/// larger one are covered by it), and multicast.
const SPECIAL_V4: &[(Ipv4Addr, u8, &str)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8, "this network (RFC 791)"),
    (Ipv4Addr::new(10, 0, 0, 0), 8, "private use (RFC 1918)"),
    (
        Ipv4Addr::new(100, 64, 0, 0),
        10,
        "shared address space (RFC 6598)",
    ),
    (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback (RFC 1122)"),
    (
        Ipv4Addr::new(169, 254, 0, 0),
        16,
        "link-local, cloud metadata (RFC 3927)",
    ),
    (Ipv4Addr::new(172, 16, 0, 0), 12, "private use (RFC 1918)"),
    (
        Ipv4Addr::new(192, 0, 0, 0),
        24,
        "IETF protocol assignments (RFC 6890), with DS-Lite, PCP and TURN anycast, NAT64 discovery",
    ),
    (
        Ipv4Addr::new(192, 0, 2, 0),
        24,
        "documentation TEST-NET-1 (RFC 5737)",
    ),
    (Ipv4Addr::new(192, 31, 196, 0), 24, "AS112-v4 (RFC 7535)"),
    (Ipv4Addr::new(192, 52, 193, 0), 24, "AMT (RFC 7450)"),
    (
        Ipv4Addr::new(192, 88, 99, 0),
        24,
        "deprecated 6to4 relay anycast (RFC 7526)",
    ),
    (Ipv4Addr::new(192, 168, 0, 0), 16, "private use (RFC 1918)"),
    (
        Ipv4Addr::new(192, 175, 48, 0),
        24,
        "direct delegation AS112 (RFC 7534)",
    ),
    (Ipv4Addr::new(198, 18, 0, 0), 15, "benchmarking (RFC 2544)"),
    (
        Ipv4Addr::new(198, 51, 100, 0),
        24,
        "documentation TEST-NET-2 (RFC 5737)",
    ),
    (
        Ipv4Addr::new(203, 0, 113, 0),
        24,
        "documentation TEST-NET-3 (RFC 5737)",
    ),
    (Ipv4Addr::new(224, 0, 0, 0), 4, "multicast (RFC 5771)"),
    (
        Ipv4Addr::new(240, 0, 0, 0),
        4,
        "reserved (RFC 1112), with the limited broadcast 255.255.255.255 (RFC 919)",
    ),
];

/// What an IPv6 entry's addresses are.
#[derive(Clone, Copy)]
enum V6 {
    /// Refused.
    Special,
    /// Carries an IPv4 address in its last 32 bits: judged by it.
    V4InLast32,
    /// 6to4: carries an IPv4 address in bits 16 to 48: judged by it.
    V4After16,
}

/// IANA's IPv6 Special-Purpose Address Registry, every entry (smaller entries inside a
/// larger one are covered by it), with the unicast ranges of RFC 4291 that are not global
/// and multicast. What none of these match is refused unless it is global unicast.
const SPECIAL_V6: &[(Ipv6Addr, u8, V6, &str)] = &[
    (Ipv6Addr::UNSPECIFIED, 128, V6::Special, "unspecified (RFC 4291)"),
    (Ipv6Addr::LOCALHOST, 128, V6::Special, "loopback (RFC 4291)"),
    (
        Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0),
        96,
        V6::V4InLast32,
        "IPv4-mapped (RFC 4291)",
    ),
    (
        Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0),
        96,
        V6::V4InLast32,
        "IPv4-IPv6 translation, NAT64 (RFC 6052)",
    ),
    (
        Ipv6Addr::new(0x64, 0xff9b, 1, 0, 0, 0, 0, 0),
        48,
        V6::Special,
        "local-use IPv4-IPv6 translation (RFC 8215)",
    ),
    (
        Ipv6Addr::new(0x100, 0, 0, 0, 0, 0, 0, 0),
        64,
        V6::Special,
        "discard-only (RFC 6666)",
    ),
    (
        Ipv6Addr::new(0x100, 0, 0, 1, 0, 0, 0, 0),
        64,
        V6::Special,
        "dummy IPv6 prefix (RFC 9780)",
    ),
    (
        Ipv6Addr::new(0x2001, 0, 0, 0, 0, 0, 0, 0),
        23,
        V6::Special,
        "IETF protocol assignments (RFC 2928), with Teredo, benchmarking, AMT, AS112, ORCHID, PCP and TURN anycast",
    ),
    (
        Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0),
        32,
        V6::Special,
        "documentation (RFC 3849)",
    ),
    (
        Ipv6Addr::new(0x2002, 0, 0, 0, 0, 0, 0, 0),
        16,
        V6::V4After16,
        "6to4 (RFC 3056)",
    ),
    (
        Ipv6Addr::new(0x2620, 0x4f, 0x8000, 0, 0, 0, 0, 0),
        48,
        V6::Special,
        "direct delegation AS112 (RFC 7534)",
    ),
    (
        Ipv6Addr::new(0x3fff, 0, 0, 0, 0, 0, 0, 0),
        20,
        V6::Special,
        "documentation (RFC 9637)",
    ),
    (
        Ipv6Addr::new(0x5f00, 0, 0, 0, 0, 0, 0, 0),
        16,
        V6::Special,
        "segment routing SIDs (RFC 9602)",
    ),
    (
        Ipv6Addr::new(0xfc00, 0, 0, 0, 0, 0, 0, 0),
        7,
        V6::Special,
        "unique local, with fd00:ec2::254 (RFC 4193)",
    ),
    (
        Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0),
        10,
        V6::Special,
        "link-local (RFC 4291)",
    ),
    (
        Ipv6Addr::new(0xfec0, 0, 0, 0, 0, 0, 0, 0),
        10,
        V6::Special,
        "site-local, deprecated (RFC 3879)",
    ),
    (
        Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0),
        8,
        V6::Special,
        "multicast (RFC 4291)",
    ),
];

/// Global unicast (RFC 4291): the only IPv6 space a receiver can be in.
const GLOBAL_UNICAST: (Ipv6Addr, u8) = (Ipv6Addr::new(0x2000, 0, 0, 0, 0, 0, 0, 0), 3);

/// Whether an address is one a tenant's webhook must not reach.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => internal_v4(v4),
        IpAddr::V6(v6) => internal_v6(v6),
    }
}

fn internal_v4(v4: Ipv4Addr) -> bool {
    let bits = u32::from(v4);
    SPECIAL_V4
        .iter()
        .any(|&(net, len, _)| within(bits, u32::from(net), len))
}

fn internal_v6(v6: Ipv6Addr) -> bool {
    let bits = u128::from(v6);
    let found = SPECIAL_V6
        .iter()
        .find(|&&(net, len, _, _)| within(bits, u128::from(net), len));
    match found {
        Some((_, _, V6::Special, _)) => true,
        Some((_, _, V6::V4InLast32, _)) => internal_v4(Ipv4Addr::from(bits as u32)),
        Some((_, _, V6::V4After16, _)) => internal_v4(Ipv4Addr::from((bits >> 80) as u32)),
        None => !within(bits, u128::from(GLOBAL_UNICAST.0), GLOBAL_UNICAST.1),
    }
}

/// Whether `addr` is in `net/len`.
fn within<T>(addr: T, net: T, len: u8) -> bool
where
    T: Copy + std::ops::BitXor<Output = T> + std::ops::Shr<u32, Output = T> + PartialEq + From<u8>,
{
    let width = (std::mem::size_of::<T>() * 8) as u32;
    let len = u32::from(len);
    len == 0 || (addr ^ net) >> (width - len) == T::from(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn internal(ip: &str) -> bool {
        is_internal(ip.parse().unwrap_or_else(|_| panic!("{ip} parses")))
    }

    /// Each IPv4 entry: its first and last address refused, and a public neighbour below
    /// and above allowed, where one exists.
    #[test]
    fn every_ipv4_special_range_is_refused_and_its_neighbours_are_not() {
        let cases: &[(&str, &str, &[&str])] = &[
            ("0.0.0.0", "0.255.255.255", &["1.0.0.0"]),
            ("10.0.0.0", "10.255.255.255", &["9.255.255.255", "11.0.0.0"]),
            (
                "100.64.0.0",
                "100.127.255.255",
                &["100.63.255.255", "100.128.0.0"],
            ),
            ("127.0.0.0", "127.255.255.255", &["126.255.255.255", "128.0.0.0"]),
            (
                "169.254.0.0",
                "169.254.255.255",
                &["169.253.255.255", "169.255.0.0"],
            ),
            ("172.16.0.0", "172.31.255.255", &["172.15.255.255", "172.32.0.0"]),
            ("192.0.0.0", "192.0.0.255", &["191.255.255.255", "192.0.1.0"]),
            ("192.0.2.0", "192.0.2.255", &["192.0.3.0"]),
            (
                "192.31.196.0",
                "192.31.196.255",
                &["192.31.195.255", "192.31.197.0"],
            ),
            (
                "192.52.193.0",
                "192.52.193.255",
                &["192.52.192.255", "192.52.194.0"],
            ),
            ("192.88.99.0", "192.88.99.255", &["192.88.98.255", "192.88.100.0"]),
            (
                "192.168.0.0",
                "192.168.255.255",
                &["192.167.255.255", "192.169.0.0"],
            ),
            (
                "192.175.48.0",
                "192.175.48.255",
                &["192.175.47.255", "192.175.49.0"],
            ),
            ("198.18.0.0", "198.19.255.255", &["198.17.255.255", "198.20.0.0"]),
            (
                "198.51.100.0",
                "198.51.100.255",
                &["198.51.99.255", "198.51.101.0"],
            ),
            ("203.0.113.0", "203.0.113.255", &["203.0.112.255", "203.0.114.0"]),
            ("224.0.0.0", "239.255.255.255", &["223.255.255.255"]),
            ("240.0.0.0", "255.255.255.255", &[]),
        ];
        assert_eq!(cases.len(), SPECIAL_V4.len(), "a case per entry");
        for (first, last, public) in cases {
            assert!(internal(first), "{first}");
            assert!(internal(last), "{last}");
            for ip in *public {
                assert!(!internal(ip), "{ip} is public");
            }
        }
        for named in ["169.254.169.254", "100.100.100.200", "192.0.0.9", "192.0.0.170"] {
            assert!(internal(named), "{named}");
        }
        for public in ["8.8.8.8", "1.1.1.1", "93.184.215.14"] {
            assert!(!internal(public), "{public}");
        }
    }

    /// Each IPv6 entry: its first and last address refused (or, for a prefix carrying an
    /// IPv4 address, refused with an internal one and allowed with a public one), and a
    /// public neighbour allowed where one exists.
    #[test]
    fn every_ipv6_special_range_is_refused_and_its_neighbours_are_not() {
        let refused: &[(&str, &str)] = &[
            ("::", "::"),
            ("::1", "::1"),
            ("::ffff:0.0.0.0", "::ffff:10.255.255.255"),
            ("64:ff9b::a9fe:a9fe", "64:ff9b::7f00:1"),
            ("64:ff9b:1::", "64:ff9b:1:ffff:ffff:ffff:ffff:ffff"),
            ("100::", "100::ffff:ffff:ffff:ffff"),
            ("100:0:0:1::", "100::1:ffff:ffff:ffff:ffff"),
            ("2001::", "2001:1ff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("2001:db8::", "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("2002:a00:1::", "2002:c0a8:101:ffff:ffff:ffff:ffff:ffff"),
            ("2620:4f:8000::", "2620:4f:8000:ffff:ffff:ffff:ffff:ffff"),
            ("3fff::", "3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("5f00::", "5f00:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("fc00::", "fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("fe80::", "febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("fec0::", "feff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
            ("ff00::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
        ];
        assert_eq!(refused.len(), SPECIAL_V6.len(), "a case per entry");
        for (first, last) in refused {
            assert!(internal(first), "{first}");
            assert!(internal(last), "{last}");
        }
        for public in [
            "::ffff:8.8.8.8",   // mapped public address
            "64:ff9b::808:808", // NAT64 of a public address
            "2002:808:808::1",  // 6to4 of a public address
            "2001:200::1",      // just above 2001::/23
            "2001:db7:ffff::1", // just below the documentation /32
            "2001:db9::1",      // just above it
            "2620:4f:7fff::1",  // beside the AS112 /48
            "2620:4f:8001::1",
            "3ffe:ffff::1",             // just below 3fff::/20
            "3fff:1000::1",             // just above it
            "2606:4700:4700::1111",     // a public resolver
            "2a00:1450:4001:80b::200e", // a public web server
        ] {
            assert!(!internal(public), "{public} is public");
        }
        // Outside global unicast, whatever the registry says of it: IPv4-compatible
        // addresses, the rest of ::/8, 4000::/3 and the other reserved blocks.
        for reserved in [
            "::169.254.169.254",
            "::8.8.8.8",
            "::ffff:0:a00:1",
            "1::1",
            "4000::1",
            "5eff::1",
            "5f01::1",
            "8000::1",
            "e000::1",
            "1fff:ffff::1",
            "4000::",
        ] {
            assert!(internal(reserved), "{reserved}");
        }
        assert!(
            !internal("2000::1") && !internal("3ffe::1"),
            "global unicast's ends"
        );
    }

    #[test]
    fn prefix_arithmetic() {
        assert!(within(u32::from(Ipv4Addr::new(1, 2, 3, 4)), 0, 0), "/0 holds all");
        assert!(within(7u32, 7, 32) && !within(6u32, 7, 32));
        assert!(within(u128::MAX, u128::MAX, 128) && !within(u128::MAX - 1, u128::MAX, 128));
    }
}
