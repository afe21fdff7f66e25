package clientinfo

import (
	"fmt"
	"strings"
)

// iso3166 holds the 249 officially assigned ISO 3166-1 alpha-2 codes, two
// upper-case letters each, in alphabetical order. Reserved codes (UK, EU,
// XK) are not countries an exit IP can be in as far as a provider's
// geolocation database goes, so they are refused with the code to use.
const iso3166 = "" +
	"AD AE AF AG AI AL AM AO AQ AR AS AT AU AW AX AZ BA BB BD BE BF BG BH BI BJ BL BM BN BO BQ " +
	"BR BS BT BV BW BY BZ CA CC CD CF CG CH CI CK CL CM CN CO CR CU CV CW CX CY CZ DE DJ DK DM " +
	"DO DZ EC EE EG EH ER ES ET FI FJ FK FM FO FR GA GB GD GE GF GG GH GI GL GM GN GP GQ GR GS " +
	"GT GU GW GY HK HM HN HR HT HU ID IE IL IM IN IO IQ IR IS IT JE JM JO JP KE KG KH KI KM KN " +
	"KP KR KW KY KZ LA LB LC LI LK LR LS LT LU LV LY MA MC MD ME MF MG MH MK ML MM MN MO MP MQ " +
	"MR MS MT MU MV MW MX MY MZ NA NC NE NF NG NI NL NO NP NR NU NZ OM PA PE PF PG PH PK PL PM " +
	"PN PR PS PT PW PY QA RE RO RS RU RW SA SB SC SD SE SG SH SI SJ SK SL SM SN SO SR SS ST SV " +
	"SX SY SZ TC TD TF TG TH TJ TK TL TM TN TO TR TT TV TW TZ UA UG UM US UY UZ VA VC VE VG VI " +
	"VN VU WF WS YE YT ZA ZM ZW"

// countryHints names the code to use for common codes that are not
// ISO 3166-1 alpha-2 country codes.
var countryHints = map[string]string{"UK": "GB", "EL": "GR"}

// ParseCountry is the one rule for countries, wherever they are written:
// a proxy user name (-country-de), the X-Onceproxy-Country header,
// upstream.sessions, upstream.providers[].countries, an upstream rule and a
// provider API's session objects. A country is an officially assigned
// ISO 3166-1 alpha-2 code in either case; it is returned upper-case ("DE").
func ParseCountry(s string) (string, error) {
	c := strings.ToUpper(s)
	if len(c) != 2 || c[0] < 'A' || c[0] > 'Z' || c[1] < 'A' || c[1] > 'Z' || !isCountry(c) {
		if use, ok := countryHints[c]; ok {
			return "", fmt.Errorf("country %q is not an ISO 3166-1 alpha-2 code (use %s)", s, use)
		}
		return "", fmt.Errorf("country %.16q is not an ISO 3166-1 alpha-2 code (such as us, de, gb)", s)
	}
	return c, nil
}

// isCountry reports whether c, two upper-case letters, is assigned.
func isCountry(c string) bool {
	for i := 0; i+2 <= len(iso3166); i += 3 {
		if iso3166[i:i+2] == c {
			return true
		}
	}
	return false
}

// maxCity bounds a city name.
const maxCity = 48

// ParseCity is the one rule for city names (-city-NAME in a user name, a
// session's city): 1-48 letters, digits or '_', as providers write them
// ("newyork", "new_york"); returned lower-case. A city never holds '-',
// which separates the parts of a user name.
func ParseCity(s string) (string, error) {
	if s == "" {
		return "", fmt.Errorf("city is empty")
	}
	if len(s) > maxCity {
		return "", fmt.Errorf("city %.16q... is %d bytes long, more than %d", s, len(s), maxCity)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_') {
			return "", fmt.Errorf("city %q: %q is not allowed (letters, digits and '_' only)", s, c)
		}
	}
	return strings.ToLower(s), nil
}
