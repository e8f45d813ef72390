package server

// DeriveClaimSecret is derive, for tests that play a holder against a
// store whose claim key they chose.
var DeriveClaimSecret = derive
